"""Turns an API request into prompt token ids and `SamplingParams`, or a 4xx `APIError`.

Shared by the HTTP and gRPC front ends so both refuse the same things the same way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import SamplingParams, truncated_prompt
from tandem.engine.tokenizer import Tokenizer
from tandem.router.errors import APIError, bad_request


class ModelLimits(NamedTuple):
    """What the decode workers accept (asked once from a decode replica)."""

    max_model_len: int
    vocab_size: int


def tokenize_prompt(tokenizer: Tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        token_ids = tokenizer.encode(prompt)
    else:
        token_ids = list(prompt)
        check_token_ids(token_ids, vocab_size, "prompt", "prompt token ids")
    if not token_ids:
        raise bad_request("prompt is empty", "prompt")
    return token_ids


def truncated(
    token_ids: list[int], keep: int, max_tokens: int | None, limits: ModelLimits
) -> list[int]:
    """The last `keep` prompt tokens (vLLM's `truncate_prompt_tokens`, left truncation); -1:
    as many as fit in the context next to `max_tokens` (at least one generated token)."""
    try:
        return truncated_prompt(token_ids, keep, limits.max_model_len, max(1, max_tokens or 1))
    except ValueError:
        raise bad_request(
            "truncate_prompt_tokens must be -1 or at least 1 (and max_tokens leave room)",
            "truncate_prompt_tokens",
        ) from None


def check_token_ids(
    token_ids: list[int], vocab_size: int, param: str, what: str = "token ids"
) -> None:
    """400 naming `param` when an id lies outside the vocabulary."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})", param)


def sampling_params(
    num_prompt_tokens: int,
    max_tokens: int | None,
    fields: dict[str, Any],
    limits: ModelLimits,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """Checks lengths against the context window, then builds the params (400 when invalid).
    With no `max_tokens`, as many as the context holds, at most `default_max_tokens`."""
    room = limits.max_model_len - num_prompt_tokens
    if room <= 0:
        raise APIError(
            413,
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {num_prompt_tokens} tokens (the prompt plus at least one generated token must "
            "fit).",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(room, default_max_tokens)
    if max_tokens <= 0:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens; "
            f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} exceed it "
            f"(at most {room} can be generated).",
            "max_tokens",
            "context_length_exceeded",
        )
    if fields.get("logit_bias"):
        check_token_ids(list(fields["logit_bias"]), limits.vocab_size, "logit_bias")
    if fields.get("allowed_token_ids"):
        check_token_ids(fields["allowed_token_ids"], limits.vocab_size, "allowed_token_ids")
    try:
        return SamplingParams(**{**fields, "max_tokens": max_tokens})
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from None
