"""Where workers report their state, so the router (and its debug endpoint) can see every replica.

A tiny named Ray actor per application. Workers push a stats snapshot when it changes (and a
heartbeat), fire and forget; readers get the entries that reported recently. Ray is imported
lazily so that the engine stays usable without it.

Losing it loses nothing that matters: Ray restarts a crashed one (empty), and a reader or a
worker that finds it dead for good (`ray.kill`, restarts used up, its node gone) makes a new
one under the same name (`registry_died`, `get_registry`). The workers' heartbeats fill it
again within seconds; the cluster token is proposed again by every worker.
"""

from __future__ import annotations

import time
from typing import Any

NAMESPACE = "tandem"
MAX_DEPARTURES = 100


class WorkerRegistry:
    """The actor's class: worker id -> last snapshot (with `reported_at`, wall-clock seconds)."""

    def __init__(self) -> None:
        self._workers: dict[str, dict[str, Any]] = {}
        self._departures: list[dict[str, Any]] = []
        self._cluster_token: str | None = None
        self._routers: dict[str, dict[str, Any]] = {}
        self._stop = ""  # "", or "stopping" (`begin_stop`), or "ending" (`end_requests`)

    def cluster_token(self, proposed: str) -> str:
        """The application's generated cluster token: `proposed` the first time, the same one
        after (a redeploy keeps it, so its new router can use the workers still running)."""
        if self._cluster_token is None:
            self._cluster_token = proposed
        return self._cluster_token

    def report(self, worker_id: str, stats: dict[str, Any]) -> None:
        self._workers[worker_id] = {**stats, "worker_id": worker_id, "reported_at": time.time()}

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def depart(self, worker_id: str, summary: dict[str, Any]) -> None:
        """A drained worker leaves; its drain `summary` is kept (the last MAX_DEPARTURES)."""
        self.remove(worker_id)
        self._departures.append({**summary, "worker_id": worker_id, "departed_at": time.time()})
        del self._departures[:-MAX_DEPARTURES]

    def departures(self) -> list[dict[str, Any]]:
        """The drains of the workers that left, oldest first."""
        return list(self._departures)

    def ping(self) -> bool:
        return True

    def begin_stop(self) -> None:
        """The application is stopping (`tandem serve`'s Ctrl-C): routers refuse new requests
        (503) while theirs in flight finish, before Serve deletes the app."""
        self._stop = "stopping"

    def end_requests(self) -> None:
        """The stop's drain ran out: routers end the requests they still run (a 503 error
        that says so, not a cut connection)."""
        self._stop = "ending"

    def end_stop(self) -> None:
        """The stop was called off (a second Ctrl-C leaves the app as it is, on a cluster that
        lives on): routers take requests again."""
        self._stop = ""

    def router_report(self, router_id: str, in_flight: int) -> str:
        """A router's requests in flight; the answer: "" (serving), "stopping" or "ending"."""
        self._routers[router_id] = {
            "router_id": router_id,
            "in_flight": in_flight,
            "stopping": bool(self._stop),
            "reported_at": time.time(),
        }
        return self._stop

    def routers(self, max_age_s: float = 3.0) -> list[dict[str, Any]]:
        """The routers that reported within `max_age_s`, each with `stopping`: whether it had
        been told so when it reported."""
        now = time.time()
        return [r for r in self._routers.values() if now - r["reported_at"] <= max_age_s]

    def list(self, max_age_s: float = 10.0) -> list[dict[str, Any]]:
        now = time.time()
        return [w for w in self._workers.values() if now - w["reported_at"] <= max_age_s]


def get_registry(name: str) -> Any:
    """The registry actor called `name` (created on first use, also after the last one died
    for good; detached, zero CPUs, restarted by Ray when its process dies)."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_restarts=-1)(WorkerRegistry)
    return actor_cls.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote()


def registry_died(exc: BaseException) -> bool:
    """Whether a registry call failed because the actor is dead for good (not restarting):
    the caller gets a new one with `get_registry`."""
    from ray.exceptions import ActorDiedError

    return isinstance(exc, ActorDiedError)


def find_registry(name: str) -> Any | None:
    """The registry actor called `name` if there is one (None: not made, or gone)."""
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def kill_registry(name: str) -> None:
    """Removes the registry actor (when the application is torn down); no-op if absent."""
    import ray

    if (registry := find_registry(name)) is not None:
        ray.kill(registry)
