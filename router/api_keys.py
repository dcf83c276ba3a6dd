"""API keys: with keys configured, clients must present one as ``Authorization: Bearer <key>``
(HTTP header or gRPC metadata), as OpenAI's API and vLLM's server expect (vLLM's `--api-key`
takes several). Health and metrics endpoints stay open for probes and Prometheus."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.router.errors import APIError
from tandem.router.openai_api import error_response

OPEN_PATHS = ("/health", "/ping", "/metrics")

KeyDigests = str | Collection[str] | None
"""The digests (`key_digest`) of the keys clients may present: one, several, or none (no key
needed)."""


def key_digest(key: str) -> str:
    """What the router is given instead of the key itself (Serve shows a deployment's init
    arguments, e.g. on the Ray dashboard): its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_api_key(expected: KeyDigests, authorization: str | None) -> None:
    """Raises a 401 `APIError` unless `authorization` is ``Bearer <key>`` for a key whose
    `key_digest` is (one of) `expected`; with no key configured every request passes."""
    digests = [expected] if isinstance(expected, str) else list(expected or ())
    if not any(digests):
        return
    scheme, _, given = (authorization or "").strip().partition(" ")
    presented = key_digest(given.strip())
    if scheme.lower() == "bearer" and any(hmac.compare_digest(presented, d) for d in digests):
        return
    raise APIError(
        401,
        "Missing or incorrect API key: send the header 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def is_open_path(path: str, root_path: str = "") -> bool:
    """Paths served without a key: exactly these under the prefix the app is mounted at
    (`root_path`: Serve's route prefix; a path that merely ends so, e.g. /v1/models/health,
    is guarded)."""
    root = root_path.rstrip("/")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    return path.rstrip("/") in OPEN_PATHS


class APIKeyMiddleware:
    """Plain ASGI middleware (no per-chunk wrapping of streamed responses): before routing and
    body parsing, a request to a guarded path without the key gets the 401 JSON body.
    `key()`, the key's digest, is read per request (the router replica sets it after the app
    is built)."""

    def __init__(self, app: ASGIApp, key: Callable[[], KeyDigests]) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        expected = self.key()
        if (
            scope["type"] == "http"
            and expected
            and not is_open_path(scope["path"], scope.get("root_path", ""))
        ):
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            try:
                check_api_key(expected, header.decode("latin-1"))
            except APIError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
