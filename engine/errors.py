"""Exceptions raised by the engine for bad input, bad checkpoints and failed steps.

Every error a user can cause is one of these, with a message that names what was wrong and what is
accepted, so that servers can map them to HTTP 4xx without a stack trace.
"""

from __future__ import annotations

from typing import Any


class TandemError(Exception):
    """Base class of tandem's own errors."""


class InvalidRequestError(TandemError, ValueError):
    """A request or its sampling parameters are invalid (maps to HTTP 400); `param`: the
    field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit in max_model_len."""


class UnsupportedModelError(TandemError, ValueError):
    """The checkpoint's architecture or a feature of its config is not supported."""


class CheckpointError(TandemError, FileNotFoundError):
    """A checkpoint directory or one of its files is missing or unreadable."""


class StepFailedError(TandemError, RuntimeError):
    """A step failed inside the engine (model, sampler, grammar or output code). `request_ids`
    are the requests of its batch: a server fails those (`abort`) and may serve on."""

    def __init__(self, request_ids: tuple[str, ...], cause: Exception) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


def summarize_validation(exc: Any) -> str:
    """A pydantic `ValidationError` in one line: ``field.path: message; ...`` (no URLs, no input
    echo), for error replies and command-line messages."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)  # (none: the whole model's check)
    return "; ".join(parts)
