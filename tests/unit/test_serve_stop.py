"""What `tandem serve`'s stop waits for: the decisions, with Ray and Serve faked."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.deploy import ray_cluster


def routers(monkeypatch: pytest.MonkeyPatch, answer: Any) -> list[str]:
    asked: list[str] = []

    def ask(registry_name: str, method: str, timeout_s: float = 5.0) -> Any:
        asked.append(method)
        return answer

    monkeypatch.setattr(ray_cluster, "_ask_registry", ask)
    return asked


@pytest.mark.parametrize(
    ("answer", "drains"),
    [
        ([{"in_flight": 0, "stopping": False}, {"in_flight": 2, "stopping": False}], True),
        ([{"in_flight": 0, "stopping": False}], False),  # (routers up, nothing to drain)
        ([], False),
        (None, False),  # (no registry yet)
    ],
)
def test_a_stop_while_starting_drains_only_requests_in_flight(
    monkeypatch: pytest.MonkeyPatch, answer: Any, drains: bool
) -> None:
    asked = routers(monkeypatch, answer)
    monkeypatch.setattr(ray_cluster, "cluster_gone", lambda: False)
    monkeypatch.setattr(ray_cluster, "responses_in_proxies", lambda: 0)
    assert ray_cluster.drains_when_stopped_starting("reg", True, terminated=True) is drains
    assert asked == ["routers"]


def test_a_request_the_routers_have_not_reported_yet_is_drained_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    routers(monkeypatch, [{"in_flight": 0, "stopping": False}])
    monkeypatch.setattr(ray_cluster, "cluster_gone", lambda: False)
    monkeypatch.setattr(ray_cluster, "responses_in_proxies", lambda: 1)  # (Serve's proxy has it)
    assert ray_cluster.drains_when_stopped_starting("reg", True, terminated=False) is True


def test_a_stop_while_starting_on_a_joined_cluster_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = routers(monkeypatch, [])
    assert ray_cluster.drains_when_stopped_starting("reg", False, terminated=False) is True
    assert asked == []  # (the app goes, the cluster stays: always drained)


def test_a_sigterm_that_took_the_head_drains_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = routers(monkeypatch, [{"in_flight": 3}])
    monkeypatch.setattr(ray_cluster, "cluster_gone", lambda: True)
    assert ray_cluster.drains_when_stopped_starting("reg", True, terminated=True) is False
    assert asked == []  # (the registry is not asked: it would not answer)


@pytest.mark.parametrize("cluster_goes", [True, False])
def test_the_stop_waits_for_serves_proxies_only_when_the_cluster_goes(
    monkeypatch: pytest.MonkeyPatch, cluster_goes: bool
) -> None:
    import ray
    from ray import serve

    from tandem.engine import worker_registry

    steps: list[str] = []
    monkeypatch.setattr(ray_cluster, "wait_for_routers", lambda *a: steps.append("routers"))
    monkeypatch.setattr(
        ray_cluster, "wait_for_proxies", lambda s: steps.append(f"proxies {s:g}") or True
    )
    monkeypatch.setattr(serve, "delete", lambda name: steps.append(f"delete {name}"))
    monkeypatch.setattr(worker_registry, "kill_registry", lambda name: steps.append("registry"))
    monkeypatch.setattr(ray, "shutdown", lambda: steps.append("ray"))
    ray_cluster.shutdown("app", "reg", True, 30.0, cluster_goes=cluster_goes)
    proxies = [f"proxies {ray_cluster.PROXY_WAIT_S:g}"] if cluster_goes else []
    assert steps == ["routers", *proxies, "delete app", "registry", "ray"]
