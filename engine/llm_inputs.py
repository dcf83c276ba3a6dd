"""What `LLM.generate` and `LLM.chat` take, as the engine takes it: vLLM's prompt forms (texts,
token-id lists, prompt dicts with their `cache_salt`), one `SamplingParams` per prompt, one
engine request per sample, and chat messages as templates take them."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.engine.chat_content import content_text, template_tool_calls
from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.seeds import sample_seed

Prompts = str | dict[str, Any] | Sequence[str] | Sequence[Sequence[int]] | Sequence[dict[str, Any]]
"""One prompt or several: texts, token id lists, or vLLM's prompt dicts."""


def engine_samples(params: SamplingParams) -> list[SamplingParams]:
    """The engine requests of `params`' `n` samples (sample i seeded `seed + i`)."""
    if params.n == 1:
        return [params]
    seeds = [sample_seed(params.seed, i) for i in range(params.n)]
    return [params.model_copy(update={"n": 1, "seed": seed}) for seed in seeds]


def _token_ids(ids: Any) -> list[int]:
    """A prompt's token ids; a `BatchEncoding` (what transformers 5's `apply_chat_template`
    returns, tokenized) gives its `input_ids`."""
    if isinstance(ids, Mapping):
        if "input_ids" not in ids:
            raise InvalidRequestError("token-id prompts are lists of ints (got a mapping)")
        ids = ids["input_ids"]
    try:
        if isinstance(ids, str | bytes | bytearray):
            raise TypeError
        # (ints, numpy's or torch's too; not floats nor digit strings, which int() would take)
        return [operator.index(t) for t in ids]
    except TypeError:
        raise InvalidRequestError(f"token-id prompts are lists of ints, got {ids!r:.80}") from None


def parse_prompts(prompts: Prompts) -> tuple[list[str | list[int]], list[str | None]]:
    """The prompts as texts and token-id lists, and each one's `cache_salt` (a dict prompt's,
    as vLLM takes it; else None)."""
    if prompts is None:
        raise InvalidRequestError("prompts: give a text, token ids or a list of them")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]  # type: ignore[assignment]
    out: list[str | list[int]] = []
    salts: list[str | None] = []
    for prompt in prompts:
        salts.append(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            if prompt.get("multi_modal_data"):
                raise InvalidRequestError("multi_modal_data: this model takes text only")
            if "prompt_token_ids" in prompt:
                out.append(_token_ids(prompt["prompt_token_ids"]))
            elif isinstance(prompt.get("prompt"), str):
                out.append(prompt["prompt"])
            else:
                raise InvalidRequestError(
                    "a dict prompt needs 'prompt' (text) or 'prompt_token_ids'"
                )
        elif isinstance(prompt, str):
            out.append(prompt)
        elif isinstance(prompt, int):
            raise InvalidRequestError(
                "token-id prompts must be a list of lists of ints, one per prompt"
            )
        else:
            out.append(_token_ids(prompt))
    return out, salts


def salted(params: list[SamplingParams], salts: list[str | None]) -> list[SamplingParams]:
    """Each prompt's params with its prompt's `cache_salt` (a copy where it has one)."""
    salted = []
    for p, salt in zip(params, salts, strict=True):
        if salt is not None:
            p = p.model_copy()
            p.cache_salt = salt  # (checked as the constructor checks it)
        salted.append(p)
    return salted


def params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams], n: int
) -> list[SamplingParams]:
    """One `SamplingParams` for each of `n` prompts: the one given, or a list of `n`."""
    if isinstance(params, SamplingParams):
        return [params] * n
    # (a dict of fields is one wrong item: refused below with the others)
    given: list[Any] = [params] if isinstance(params, Mapping) else list(params)
    if not all(isinstance(p, SamplingParams) for p in given):
        raise InvalidRequestError(
            "sampling_params: a SamplingParams or a list of them, one per prompt "
            "(a dict of fields: SamplingParams(**fields))"
        )
    if len(given) != n:
        raise InvalidRequestError(f"got {len(given)} SamplingParams for {n} prompts")
    return given


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with a content given as OpenAI's parts as one string (`content_text`), and
    its tool calls' arguments as objects (`template_tool_calls`)."""
    content = message.get("content")
    if isinstance(content, list) or content is None:
        # (None or none: an assistant turn of calls alone; templates read its content as "")
        message = {**message, "content": content_text(content)}
    if message.get("tool_calls") == []:  # (a reply of no calls: none, as vLLM drops it)
        message = {k: v for k, v in message.items() if k != "tool_calls"}
    if "tool_calls" in message:
        message = {**message, "tool_calls": template_tool_calls(message["tool_calls"])}
    return message
