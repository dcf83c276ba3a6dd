"""API keys: with one configured, clients must present it as ``Authorization: Bearer <key>``
(HTTP header or gRPC metadata), as OpenAI's API and vLLM's server expect. Health and metrics
endpoints stay open for probes and Prometheus."""

from __future__ import annotations

import hmac

from tandem.router.errors import APIError

OPEN_PATHS = ("/health", "/metrics")


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raises a 401 `APIError` unless `authorization` is ``Bearer <expected>``; with no key
    configured every request passes."""
    if not expected:
        return
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), expected.encode()
    ):
        return
    raise APIError(
        401,
        "Missing or incorrect API key: send the header 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def is_open_path(path: str) -> bool:
    """Paths served without a key (whatever prefix the app is mounted under)."""
    return path.rstrip("/").endswith(OPEN_PATHS)
