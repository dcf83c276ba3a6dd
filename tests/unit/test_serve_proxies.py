"""The stop waits for Serve's proxies to send the streams their routers finished."""

from __future__ import annotations

import pytest

from tandem.deploy import serve_proxies
from tandem.deploy.serve_proxies import responses_in_proxy, wait_for_proxies


class Part:
    def __init__(self, ongoing: int) -> None:
        self._ongoing_requests = ongoing


class Proxy:
    def __init__(self, http: int, grpc: int | None) -> None:
        self.http_proxy = Part(http)
        self.grpc_proxy = None if grpc is None else Part(grpc)


def test_a_proxy_counts_http_and_grpc_responses() -> None:
    assert responses_in_proxy(Proxy(2, 3)) == 5
    assert responses_in_proxy(Proxy(1, None)) == 1


def test_waits_until_every_proxy_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_proxies, "POLL_S", 0.0)
    left = {"a": [2, 1, 0, 0], "b": [1, 1, 1, 0]}
    asked: list[str] = []

    def counter(name: str) -> serve_proxies.Counter:
        def count(timeout: float) -> int:
            asked.append(name)
            return left[name].pop(0)

        return count

    assert wait_for_proxies(10.0, [counter("a"), counter("b")]) is True
    assert asked == ["a", "b"] * 4  # (each asked until both said 0 in one round)


def test_a_proxy_that_fails_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_proxies, "POLL_S", 0.0)

    def dead(timeout: float) -> int:
        raise RuntimeError("actor died")

    assert wait_for_proxies(10.0, [dead]) is True


def test_gives_up_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_proxies, "POLL_S", 0.01)
    assert wait_for_proxies(0.05, [lambda timeout: 1]) is False
