"""The router's Serve deployment: a replica keeps actor slots free for Serve's control calls
(at 1024 ongoing requests, above Ray's default concurrency of an async actor, Serve made the
actor's equal, and 1024 clients that never sent their body starved the controller's health
checks: the replica was restarted, every stream on it lost); a 405 names every method its
path takes."""

from __future__ import annotations

from ray._common.ray_constants import DEFAULT_MAX_CONCURRENCY_ASYNC

from tandem.router.deployment import ROUTER_MAX_ONGOING, Router


def test_the_router_takes_fewer_requests_than_its_actor_has_slots() -> None:
    assert Router.max_ongoing_requests == ROUTER_MAX_ONGOING
    assert ROUTER_MAX_ONGOING <= DEFAULT_MAX_CONCURRENCY_ASYNC - 32


def test_a_405_names_every_method_of_its_path() -> None:
    """Starlette's Allow named the first route's method only (POST for GET /ping)."""
    import asyncio

    from tandem.router.deployment import api

    async def status_and_allow(method: str, path: str) -> tuple[int, str]:
        scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": [], "http_version": "1.1", "scheme": "http",
                 "server": ("test", 80), "client": ("test", 1), "root_path": ""}  # fmt: skip
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        await api(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        headers = dict(start["headers"])  # type: ignore[call-overload]
        return int(start["status"]), headers.get(b"allow", b"").decode()  # type: ignore[call-overload]

    assert asyncio.run(status_and_allow("PUT", "/ping")) == (405, "GET, POST")
    assert asyncio.run(status_and_allow("PUT", "/v1/responses/r1")) == (405, "DELETE, GET")
    assert asyncio.run(status_and_allow("GET", "/v1/completions")) == (405, "POST")
