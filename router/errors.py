"""Errors the API answers with: an HTTP status and an OpenAI-style JSON body, never a trace."""

from __future__ import annotations

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
            if self.status == 429:
                metrics.rejected(self.code or "rate_limited")
            else:
                metrics.failed(self.code or self.type)
            self.counted = True

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


def unavailable(message: str, code: str = "unavailable") -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code, headers=RETRY_AFTER)


class WorkerLost(APIError):
    """A worker's connection broke or was refused (it died, or its process hangs): 503. A
    request that has sent its caller nothing yet can start over on the workers still alive."""

    def __init__(self, worker_id: str, message: str, code: str) -> None:
        super().__init__(
            503, message, type="service_unavailable_error", code=code, headers=RETRY_AFTER
        )
        self.worker_id = worker_id
