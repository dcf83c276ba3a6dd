"""`check_api_key`: Bearer scheme, exact key, nothing required without one; the router is
given the key's digest, never the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.router.api_keys import check_api_key, is_open_path, key_digest
from tandem.router.errors import APIError


def test_no_key_configured_lets_everything_through() -> None:
    check_api_key(None, None)
    check_api_key("", "Bearer whatever")


@pytest.mark.parametrize("header", ["Bearer k3y", "bearer k3y", "  Bearer   k3y  "])
def test_the_right_key_passes(header: str) -> None:
    check_api_key(key_digest("k3y"), header)


@pytest.mark.parametrize("header", [None, "", "k3y", "Basic k3y", "Bearer k3", "Bearer k3y2"])
def test_anything_else_is_401_with_an_openai_style_body(header: str | None) -> None:
    with pytest.raises(APIError) as refused:
        check_api_key(key_digest("k3y"), header)
    assert refused.value.status == 401
    assert refused.value.body()["error"]["code"] == "invalid_api_key"
    assert refused.value.headers == {"WWW-Authenticate": "Bearer"}


def test_any_of_several_keys_passes_and_no_other() -> None:
    """vLLM's `--api-key a b`: a client may present any of them."""
    keys = [key_digest("k1"), key_digest("k2")]
    check_api_key(keys, "Bearer k1")
    check_api_key(keys, "Bearer k2")
    for header in ("Bearer k3", "Bearer k1k2", None):
        with pytest.raises(APIError):
            check_api_key(keys, header)
    check_api_key([], "Bearer anything")  # (none configured)


def test_the_serve_command_takes_several_keys_as_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Repeated, several after one flag, or from `VLLM_API_KEY` / `TANDEM_API_KEY`; the router
    gets every key's digest."""
    from tandem.deploy.app_builder import build_app
    from tandem.deploy.cluster_config import ClusterConfig
    from tandem.deploy.tiny_model import build_tiny_checkpoint
    from tests.unit.test_serve_vllm_flags import _serve, _serve_args

    model = build_tiny_checkpoint(tmp_path / "m")
    for env in ("TANDEM_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    _, seen = _serve(monkeypatch, model, "--api-key", "k1", "k2", "--port", "28000")
    _, again = _serve_args(monkeypatch, "--api-key", "k1", "--api-key", "k2", "--model", str(model))
    _, single = _serve(monkeypatch, model, "--api-key", "k1")
    monkeypatch.setenv("VLLM_API_KEY", "from env")  # (one key, spaces and all, as vLLM's)
    _, env = _serve(monkeypatch, model)
    monkeypatch.setenv("TANDEM_API_KEY", "ours")
    _, ours = _serve(monkeypatch, model)
    assert [c.api_key for c in seen + again + single + env + ours] == [
        ["k1", "k2"], ["k1", "k2"], "k1", "from env", "ours",
    ]  # fmt: skip
    assert seen[0].port == 28000  # (the values ended at the next flag)
    app = build_app(ClusterConfig(model=str(model), api_key=["k1", "k2"]))
    settings = app._bound_deployment.init_args[0]
    assert settings["api_key_sha256"] == [key_digest("k1"), key_digest("k2")]


def test_probes_and_metrics_stay_open_under_the_apps_prefix_only() -> None:
    assert is_open_path("/health") and is_open_path("/tandem/metrics/", "/tandem")
    assert is_open_path("/ping/", "/") and is_open_path("/metrics", "")
    assert not is_open_path("/v1/models") and not is_open_path("/debug/workers")
    # (a path that only ends so was open: a 404 there named the served model without a key)
    for path in ("/v1/models/health", "/v1/models/x/metrics", "/v1/responses/ping"):
        assert not is_open_path(path) and not is_open_path(path, "/v1")
    assert not is_open_path("/tandem/metrics")  # (mounted at /, that is another path)


def test_the_router_is_given_the_keys_digest_not_the_key(tmp_path: Path) -> None:
    """Serve shows a deployment's init arguments (Ray dashboard, `serve status`)."""
    from tandem.deploy.app_builder import build_app
    from tandem.deploy.cluster_config import ClusterConfig
    from tandem.deploy.tiny_model import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "m")
    app = build_app(ClusterConfig(model=str(model), api_key="s3cret-key"))
    settings = app._bound_deployment.init_args[0]
    assert "s3cret-key" not in repr(app._bound_deployment.init_args)
    assert settings["api_key_sha256"] == [key_digest("s3cret-key")]
    assert "api_key" not in settings
