"""What the engine hands back: per-step token events and the final per-request result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

TokenLogprob = tuple[float, list[tuple[int, float]]]
"""A generated token's log-probability, and its request's `logprobs` most likely tokens as
(token id, log-probability), most likely first. As JSON: `[lp, [[id, lp], ...]]`."""

PromptLogprob = tuple[float, list[tuple[int, float]], int]
"""A prompt token's: the same, and its rank in the vocabulary (1: the most likely; tokens as
likely count before it, as vLLM ranks). As JSON: `[lp, [[id, lp], ...], rank]`."""


class StepOutput(NamedTuple):
    """One request's progress in one engine step (a streamed token event)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asks


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
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, when asked
    prompt_logprobs: list[PromptLogprob | None] | None = None  # per prompt token (the first None)
