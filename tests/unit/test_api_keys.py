"""`check_api_key`: Bearer scheme, exact key, nothing required without one."""

from __future__ import annotations

import pytest

from tandem.router.api_keys import check_api_key, is_open_path
from tandem.router.errors import APIError


def test_no_key_configured_lets_everything_through() -> None:
    check_api_key(None, None)
    check_api_key("", "Bearer whatever")


@pytest.mark.parametrize("header", ["Bearer k3y", "bearer k3y", "  Bearer   k3y  "])
def test_the_right_key_passes(header: str) -> None:
    check_api_key("k3y", header)


@pytest.mark.parametrize("header", [None, "", "k3y", "Basic k3y", "Bearer k3", "Bearer k3y2"])
def test_anything_else_is_401_with_an_openai_style_body(header: str | None) -> None:
    with pytest.raises(APIError) as refused:
        check_api_key("k3y", header)
    assert refused.value.status == 401
    assert refused.value.body()["error"]["code"] == "invalid_api_key"
    assert refused.value.headers == {"WWW-Authenticate": "Bearer"}


def test_probes_and_metrics_stay_open_under_any_prefix() -> None:
    assert is_open_path("/health") and is_open_path("/tandem/metrics/")
    assert not is_open_path("/v1/models") and not is_open_path("/debug/workers")
