"""A router's gate for new requests while the application stops.

`tandem serve`'s Ctrl-C tells the worker registry first (`WorkerRegistry.begin_stop`); each
router reads it with its report of the requests it has in flight (`follow_stop`), and from then
on answers new requests with a 503 (OpenAI error JSON, `Retry-After`; gRPC UNAVAILABLE, health
NOT_SERVING) while those in flight finish. Only once none are left is the app deleted: Serve's
proxy answers 404 in plain text for an app it is deleting, which clients read as a wrong URL
and do not retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.router.api_keys import is_open_path
from tandem.router.errors import APIError, unavailable
from tandem.router.openai_api import error_response

logger = logging.getLogger("tandem.router")

REPORT_S = 0.5
"""How often a router reports its requests in flight (and learns whether the app stops)."""


class StopGate:
    """Whether the application stops, and how many requests this router has in flight."""

    def __init__(self) -> None:
        self.stopping = False
        self.in_flight = 0

    def refusal(self) -> APIError | None:
        """The 503 a new request gets once stopping, else None."""
        if not self.stopping:
            return None
        return unavailable("the server is shutting down: try again shortly", "shutting_down")

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Counts a request in flight while the block runs; raises `refusal()` once stopping."""
        if (refused := self.refusal()) is not None:
            raise refused
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class StopGateMiddleware:
    """Plain ASGI middleware (nothing wraps a stream's chunks): a request counts in flight until
    its response has been sent; once stopping, a new one gets the 503 JSON body, but for the
    open paths (health: its own answer says "stopping"; metrics)."""

    def __init__(self, app: ASGIApp, gate: Callable[[], StopGate | None]) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = self.gate()
        if (
            scope["type"] != "http"
            or gate is None
            or is_open_path(scope["path"], scope.get("root_path", ""))
        ):
            await self.app(scope, receive, send)
            return
        if (refused := gate.refusal()) is not None:
            await error_response(refused)(scope, receive, send)
            return
        with gate.admitted():
            await self.app(scope, receive, send)


async def follow_stop(
    gate: StopGate,
    router_id: str,
    registry: Callable[[], Any],
    end_requests: Callable[[], None],
) -> None:
    """Reports this router's requests in flight to the registry every `REPORT_S`, and sets
    `gate.stopping` from its answer; `end_requests()` once it says the stop's drain ran out.
    `registry()`: the current registry actor (it may have been replaced after dying)."""
    ended = False
    while True:
        try:
            state = await registry().router_report.remote(router_id, gate.in_flight)
            if state and not gate.stopping:
                logger.info(
                    "router %s: the application stops: new requests are refused (503), "
                    "%d in flight finish",
                    router_id,
                    gate.in_flight,
                )
            gate.stopping = bool(state)
            if state == "ending" and not ended:
                ended = True
                logger.info("router %s: ending the %d requests still running", router_id,
                            gate.in_flight)  # fmt: skip
                end_requests()
        except Exception as exc:  # the registry may be restarting: the next report tells
            logger.debug("reporting to the worker registry failed: %r", exc)
        await asyncio.sleep(REPORT_S)
