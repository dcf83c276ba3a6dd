"""A router replica keeps actor slots free for Serve's control calls: at 1024 ongoing
requests (above Ray's default concurrency of an async actor, so Serve made the actor's equal),
1024 clients that never sent their body starved the controller's health checks and the replica
was restarted, every stream on it lost."""

from __future__ import annotations

from ray._common.ray_constants import DEFAULT_MAX_CONCURRENCY_ASYNC

from tandem.router.deployment import ROUTER_MAX_ONGOING, Router


def test_the_router_takes_fewer_requests_than_its_actor_has_slots() -> None:
    assert Router.max_ongoing_requests == ROUTER_MAX_ONGOING
    assert ROUTER_MAX_ONGOING <= DEFAULT_MAX_CONCURRENCY_ASYNC - 32
