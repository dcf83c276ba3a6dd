"""What the engine hands back: per-step token events and the final per-request result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class StepOutput(NamedTuple):
    """One request's progress in one engine step (a streamed token event)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None


@dataclass
class RequestOutput:
    """The result of one request (vLLM-compatible field names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    finished: bool = True
