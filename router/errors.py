"""Errors the API answers with: an HTTP status and an OpenAI-style JSON body, never a trace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class APIError(Exception):
    """A request the router refuses or could not serve; `status` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.counted = False  # in the router's metrics already (a refusal or failure)

    def count(self, metrics: Any) -> None:
        """Counts the refusal in the router's `metrics` (`RouterMetrics`) unless it is already:
        a 429 as an admission rejection, any other as a failure."""
        if not self.counted:
            self.tally(metrics)
            self.counted = True

    def tally(self, metrics: Any) -> None:
        """Counts it once more (another choice of the request it refused)."""
        if self.status == 429:
            metrics.rejected(self.code or "rate_limited")
        else:
            metrics.failed(self.code or self.type)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


RETRY_AFTER = {"Retry-After": "1"}
"""With every 429 and 503: a client may try again in a second."""


def invalid_body(errors: Sequence[Any], body: Any) -> APIError:
    """A 400 for a body its schema refused (pydantic's `errors()`): every error in the
    message, the first one's field as `param`."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    message = "; ".join(parts) or "invalid request"
    return APIError(400, message, param=_param(errors[0], body) if errors else None)


def _param(error: dict[str, Any], body: Any) -> str | None:
    """The request field an error is about: its location's steps that are in the body (not
    the names of the types a field may take: `prompt`, not `prompt.str`), and the field's
    own name when it is missing."""
    loc = [step for step in error.get("loc", ()) if step != "body"]
    missing = loc.pop() if error.get("type") == "missing" and loc else None
    steps: list[str] = []
    value = body
    for step in loc:
        in_list = isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value)
        if not (in_list or (isinstance(value, dict) and step in value)):
            break
        value = value[step]
        steps.append(str(step))
    if missing is not None and len(steps) == len(loc):
        steps.append(str(missing))
    return ".".join(steps) or None


def unavailable(message: str, code: str = "unavailable") -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code, headers=RETRY_AFTER)


class WorkerLost(APIError):
    """A worker's connection broke or was refused (it died, or its process hangs): 503. A
    request that has sent its caller nothing yet can start over on the workers still alive."""

    def __init__(self, worker_id: str, message: str, code: str, drained: bool = False) -> None:
        """`drained`: the worker was draining (Serve stopping it) and left before the request
        ended (its `drain_timeout_s` ran out), as against dying."""
        super().__init__(
            503, message, type="service_unavailable_error", code=code, headers=RETRY_AFTER
        )
        self.worker_id = worker_id
        self.drained = drained
