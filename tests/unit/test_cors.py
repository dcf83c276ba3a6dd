"""The API's CORS (`router/cors.py`): a browser's preflight and requests from an allowed origin
get the CORS headers; other clients, and a router with CORS off, pass through untouched."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.router.cors import LateCORS


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-app", b"1")]})
    await send({"type": "http.response.body", "body": b"{}"})


def call(origins: list[str], method: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": "/v1/chat/completions",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(LateCORS(_app, lambda: origins)(scope, receive, send))
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


PREFLIGHT = {
    "Origin": "http://ui.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_a_preflight_from_any_origin_is_allowed_by_default() -> None:
    status, headers = call(["*"], "OPTIONS", PREFLIGHT)
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers = call(["*"], "POST", {"Origin": "http://ui.example"})
    assert (status, headers["access-control-allow-origin"], headers["x-app"]) == (200, "*", "1")


def test_listed_origins_only_and_off_when_empty() -> None:
    allowed = ["http://ui.example"]
    status, headers = call(allowed, "OPTIONS", {**PREFLIGHT, "Origin": "http://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers = call(allowed, "POST", {"Origin": "http://ui.example"})
    assert headers["access-control-allow-origin"] == "http://ui.example"
    for origins in ([], ["*"]):  # no Origin header: the app's answer as it is
        assert call(origins, "POST", {}) == (200, {"x-app": "1"})
    assert call([], "POST", {"Origin": "http://ui.example"}) == (200, {"x-app": "1"})
