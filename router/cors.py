"""CORS for the API, with the allowed origins that the router replica sets once the app is
built (`router.cors_allowed_origins`; vLLM's `--allowed-origins`, all by default). A request
without an `Origin` header (every non-browser client) passes straight through."""

from __future__ import annotations

from collections.abc import Callable

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send


class LateCORS:
    """Plain ASGI middleware: `origins()` is read per request; empty, CORS is off."""

    def __init__(self, app: ASGIApp, origins: Callable[[], list[str]]) -> None:
        self.app = app
        self.origins = origins
        self._cors: tuple[tuple[str, ...], ASGIApp] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origins = tuple(self.origins())
        if (
            scope["type"] != "http"
            or not origins
            or not any(name == b"origin" for name, _ in scope.get("headers") or ())
        ):  # (Starlette's would wrap every reply's `send`: ~1.5 ms on a stream's first token)
            await self.app(scope, receive, send)
            return
        if self._cors is None or self._cors[0] != origins:
            cors = CORSMiddleware(
                self.app, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"]
            )
            self._cors = (origins, cors)
        await self._cors[1](scope, receive, send)
