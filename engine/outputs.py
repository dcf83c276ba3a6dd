"""What the engine hands back: per-step token events and the final per-request result."""

from __future__ import annotations

from dataclasses import dataclass, field
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
class Logprob:
    """vLLM's: a token's log-probability, its rank in the vocabulary (None where not
    computed: a sampled token outside the alternatives asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's `RequestOutput.outputs` lists them."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # (with logprobs asked for)
    logprobs: list[dict[int, Logprob]] | None  # per token: itself and the alternatives
    finish_reason: str | None
    stop_reason: int | str | None = None
    lora_request: None = None  # (vLLM's field: no LoRA here)

    def finished(self) -> bool:
        """vLLM's: whether this sample ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request (vLLM-compatible field names). `outputs` holds every sample
    as vLLM's does (`SamplingParams.n`); the flat fields (`text`, `token_ids`, ...) are the
    first sample's."""

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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """vLLM's shape, when asked: per prompt token (the first None), the token itself then its
    alternatives, by token id."""
    prompt_logprob_entries: list[PromptLogprob | None] | None = None
    """The same as tandem's `PromptLogprob` tuples (the first None)."""
    outputs: list[CompletionOutput] = field(default_factory=list)
    metrics: None = None  # (vLLM's field; its V1 engine leaves it None too)
    lora_request: None = None  # (vLLM's field: no LoRA here)
