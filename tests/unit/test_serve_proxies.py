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


def test_counters_are_made_for_serve_proxy_actors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    import ray.util

    named = [
        {"name": "SERVE_PROXY_ACTOR-node1", "namespace": "serve"},
        {"name": "SERVE_CONTROLLER_ACTOR", "namespace": "serve"},
        {"name": "SERVE_PROXY_ACTOR-node2", "namespace": "other"},
        {"name": "SERVE_PROXY_ACTOR-gone", "namespace": "serve"},
    ]
    looked_up: list[tuple[str, str]] = []

    def get_actor(name: str, namespace: str) -> object:
        looked_up.append((name, namespace))
        if name.endswith("gone"):
            raise ValueError("no such actor")
        return object()

    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces: named)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    counters = serve_proxies.proxy_counters()
    assert looked_up == [("SERVE_PROXY_ACTOR-node1", "serve"), ("SERVE_PROXY_ACTOR-gone", "serve")]
    assert len(counters) == 1


def test_rays_proxy_still_keeps_the_counts_read_here() -> None:
    """`responses_in_proxy` reads Serve's private attributes: a Ray that renames them fails
    here, not silently at a stop."""
    import inspect

    from ray.serve._private import proxy

    actor_init = inspect.getsource(proxy.ProxyActor.__ray_actor_class__.__init__)
    assert "self.http_proxy =" in actor_init and "self.grpc_proxy =" in actor_init
    assert "self._ongoing_requests = 0" in inspect.getsource(proxy.GenericProxy.__init__)
    assert "self._ongoing_requests -= 1" in inspect.getsource(proxy.GenericProxy)


def test_a_proxy_without_the_counts_is_an_error() -> None:
    with pytest.raises(AttributeError):
        responses_in_proxy(object())
