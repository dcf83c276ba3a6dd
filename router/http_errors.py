"""The router app's error replies: every error, FastAPI's and Starlette's own included, as an
OpenAI-style JSON body with the right status, counted in the router's metrics once."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from tandem.router.errors import APIError, invalid_body
from tandem.router.openai_api import error_response

logger = logging.getLogger("tandem.router")


def install_error_handlers(app: FastAPI) -> None:
    """Answers `app`'s errors with the handlers below."""
    app.exception_handler(RequestValidationError)(_on_validation_error)
    app.exception_handler(APIError)(_on_api_error)
    app.exception_handler(StarletteHTTPException)(_on_http_error)
    app.exception_handler(Exception)(_on_unexpected)


def _counted(request: Request, exc: APIError) -> JSONResponse:
    """The error's reply, once it is in `tandem:request_failure_total` (or, a 429, in the
    admission rejections) if the request path did not count it already. (The app serving is
    `request.app`: Serve runs a copy of the module's `api`.)"""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        exc.count(metrics)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        invalid = APIError(400, "the request body is not valid JSON", code="invalid_json")
        return _counted(request, invalid)
    kind = request.headers.get("content-type", "")
    if request.method == "POST" and not _json_media_type(kind):  # (the body was not read)
        given = f"{kind!r}" if kind else "none"
        message = (
            f"the request body must be JSON, sent with Content-Type: application/json (got {given})"
        )
        return _counted(request, APIError(400, message, code="invalid_content_type"))
    return _counted(request, invalid_body(errors, exc.body))


def _json_media_type(content_type: str) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON: application/json or
    application/*+json (text/json or application/jsonx it leaves unread)."""
    media = content_type.split(";", 1)[0].strip().lower()
    maintype, _, subtype = media.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return _counted(request, exc)


CLIENT_LEFT = (ClientDisconnect, TaskCancelledError)
"""What reading a request's body raises when its client left: behind Serve's proxy, the proxy
cancels the replica's wait for the body's next part more often than it sends a disconnect."""


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = str(exc.detail)
    if exc.status_code == 400 and message == "There was an error parsing the body":
        if isinstance(exc.__cause__, CLIENT_LEFT):  # (the client left while sending it)
            logger.debug(
                "%s %s: the client left before its body came", request.method, request.url.path
            )
            return error_response(APIError(400, "the client left before its body came"))
        # (FastAPI's answer to a body it could not decode, e.g. bytes that are not UTF-8)
        unreadable = "the request body is not valid JSON in UTF-8"
        if isinstance(exc.__cause__, RecursionError):  # (valid JSON, too deep for Python)
            unreadable = "the request body's JSON is nested too deeply"
        return _counted(request, APIError(400, unreadable, code="invalid_json"))
    if exc.status_code in (404, 405):  # name what was asked for
        message = f"{message}: {request.method} {request.url.path}"
    headers = dict(exc.headers) if exc.headers else None
    if exc.status_code == 405:  # (RFC 9110: Allow lists every method the path takes)
        headers = {**(headers or {}), "Allow": ", ".join(_methods_of(request))}
    return error_response(APIError(exc.status_code, message, type=kind, headers=headers))


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _methods_of(request: Request) -> list[str]:
    """The methods the app's routes take at the request's path (Starlette's own Allow names
    the first route's only: GET /ping, not its POST)."""
    return [
        method
        for method in _METHODS
        if any(
            r.matches({**request.scope, "method": method})[0] == Match.FULL
            for r in request.app.routes
        )
    ]


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error")
    failed = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
    return _counted(request, failed)
