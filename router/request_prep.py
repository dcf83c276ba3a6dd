"""Turns an API request into prompt token ids and `SamplingParams`, or a 4xx `APIError`.

Shared by the HTTP and gRPC front ends so both refuse the same things the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import SamplingParams, truncated_prompt
from tandem.engine.tokenizer import Tokenizer, ids_outside_vocab
from tandem.router.errors import APIError, bad_request


class ModelLimits(NamedTuple):
    """What the decode workers accept (asked once from a decode replica)."""

    max_model_len: int
    vocab_size: int


T = TypeVar("T")

INLINE_TEXT_CHARS = 8192
"""Texts up to this long are tokenized on the event loop (well under a millisecond); longer
ones on a thread of `_TOKENIZING` (the Rust tokenizer drops the GIL), so that one large prompt
does not hold up every other request, health checks included."""
PREFIX_CHARS_PER_TOKEN = 16
"""A text longer than this many characters per token of the context is first tokenized up to
that many: when that prefix alone fills the context, the prompt is refused without tokenizing
the rest (a 30 MB prompt is a 400 in milliseconds, not after a minute of tokenizing)."""
_TOKENIZING = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


async def off_the_loop_if_long(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` here when `size` (characters of text) is small, else on a
    tokenizing thread."""
    if size <= INLINE_TEXT_CHARS:
        return fn(*args, **kwargs)
    return await on_a_tokenizing_thread(fn, *args, **kwargs)


async def on_a_tokenizing_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a thread of `_TOKENIZING`, off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_TOKENIZING, lambda: fn(*args, **kwargs))


async def sampling_fields(body: Any) -> dict[str, Any]:
    """`body.sampling_dict()`, on a tokenizing thread when the output is constrained: checking
    a grammar is xgrammar converting it, seconds for a large schema, which on the event loop
    would hold up every other request (the result is cached per text: once per schema)."""
    if not body.constrains_output():
        return body.sampling_dict()
    return await on_a_tokenizing_thread(body.sampling_dict)


def chat_text_size(messages: list[dict[str, Any]]) -> int:
    """About how many characters of text chat `messages` hold."""
    return sum(len(str(m.get("content") or "")) for m in messages)


async def prompt_token_ids(
    tokenizer: Tokenizer,
    prompt: str | list[int],
    limits: ModelLimits,
    truncating: bool,
    add_special_tokens: bool = True,
) -> list[int]:
    """`tokenize_prompt`, with a long text tokenized off the event loop, and refused early
    when a prefix already fills the context (unless the prompt is to be `truncating`)."""
    special = add_special_tokens
    if not isinstance(prompt, str) or len(prompt) <= INLINE_TEXT_CHARS:
        return tokenize_prompt(tokenizer, prompt, limits.vocab_size, special)

    def tokenize() -> list[int]:
        if not truncating:
            _refuse_when_a_prefix_fills_the_context(tokenizer, prompt, limits)
        return tokenize_prompt(tokenizer, prompt, limits.vocab_size, special)

    return await off_the_loop_if_long(len(prompt), tokenize)


def _refuse_when_a_prefix_fills_the_context(
    tokenizer: Tokenizer, text: str, limits: ModelLimits
) -> None:
    cut = PREFIX_CHARS_PER_TOKEN * limits.max_model_len
    if len(text) <= cut:
        return
    # At a space: the prefix's words are the text's first words, so it has no more tokens
    # than they do in the whole text.
    space = text.rfind(" ", cut // 2, cut)
    count = len(tokenizer.encode(text[: space if space > 0 else cut]))
    if count >= limits.max_model_len:
        raise context_exceeded(limits, count, at_least=True)


def context_exceeded(limits: ModelLimits, num_tokens: int, *, at_least: bool = False) -> APIError:
    """400 (as OpenAI's and vLLM's, so that clients catch it as a bad request): a prompt of
    `num_tokens` (`at_least` that many) leaves no room to generate."""
    has = f"at least {num_tokens}" if at_least else str(num_tokens)
    return APIError(
        400,
        f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
        f"has {has} tokens (the prompt plus at least one generated token must fit).",
        param="prompt",
        code="context_length_exceeded",
    )


def tokenize_prompt(
    tokenizer: Tokenizer, prompt: str | list[int], vocab_size: int, add_special_tokens: bool = True
) -> list[int]:
    """A prompt's token ids: a text's encoded (with the tokenizer's special tokens, e.g. BOS,
    unless not `add_special_tokens`, vLLM's field), token ids as given; checked."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        token_ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        token_ids = list(prompt)
    if not token_ids:
        raise bad_request("prompt is empty", "prompt")
    # (text too: a tokenizer may have more ids than the model)
    check_token_ids(token_ids, vocab_size, "prompt", "prompt token ids")
    return token_ids


def truncated(
    token_ids: list[int], keep: int, max_tokens: int | None, limits: ModelLimits
) -> list[int]:
    """The last `keep` prompt tokens (vLLM's `truncate_prompt_tokens`, left truncation); -1:
    as many as fit in the context next to `max_tokens` (at least one generated token)."""
    if keep > limits.max_model_len:  # (as vLLM refuses it)
        raise bad_request(
            f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
            f"({limits.max_model_len}); ask for a smaller truncation size",
            "truncate_prompt_tokens",
        )
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
    if bad := ids_outside_vocab(token_ids, vocab_size):
        raise bad_request(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})", param)


def sampling_params(
    num_prompt_tokens: int,
    max_tokens: int | None,
    fields: dict[str, Any],
    limits: ModelLimits,
    default_max_tokens: int | None = None,
    max_tokens_ceiling: int | None = None,
) -> SamplingParams:
    """Checks lengths against the context window, then builds the params (400 when invalid).
    With no `max_tokens`, `default_max_tokens` (the model's `max_new_tokens`) or as many as
    the context holds, the fewer; `max_tokens_ceiling` caps either (vLLM's rule: the model's
    own `max_new_tokens` is a default, another generation config's a ceiling)."""
    room = limits.max_model_len - num_prompt_tokens
    if room <= 0:
        raise context_exceeded(limits, num_prompt_tokens)
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
    if max_tokens_ceiling is not None:
        max_tokens = min(max_tokens, max_tokens_ceiling)
    if fields.get("logit_bias"):
        check_token_ids(list(fields["logit_bias"]), limits.vocab_size, "logit_bias")
        if beyond := {t: b for t, b in fields["logit_bias"].items() if not -100 <= b <= 100}:
            some = dict(list(beyond.items())[:5])  # (the message quotes a few, not them all)
            raise bad_request(f"logit_bias values are in [-100, 100]: {some}", "logit_bias")
    for name in ("allowed_token_ids", "stop_token_ids"):
        if fields.get(name):
            check_token_ids(fields[name], limits.vocab_size, name)
    try:
        return SamplingParams(**{**fields, "max_tokens": max_tokens})
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from None


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """The token ids of chat `messages` through the chat template (`options`: those of
    `Tokenizer.apply_chat_template`); a 400 if it fails."""
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except Exception as exc:  # (the template's own refusals, and what its code raises on
        # messages it does not expect: `| dictsort` of a string, a division by zero)
        hint = (
            ""
            if tokenizer.hf.chat_template
            else " (the model has none: serve it with --chat-template)"
        )
        raise bad_request(f"cannot apply the chat template: {exc}{hint}", "messages") from None
