"""OpenAI response bodies and SSE events for completions and chat, one or several choices.

A response has one id and one `created` time for all its choices; choice `index` i is the i-th
request of the response (`prompt_index * n + sample_index`, as OpenAI and vLLM number them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tandem.router.openai_logprobs import (
    TokenBytes,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_field,
)
from tandem.router.prepared import Prepared
from tandem.router.reasoning import ReasoningParser
from tandem.router.tool_calls import ReplyParser, finishes_with_calls

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one response repeats."""

    response_id: str
    created: int
    model: str
    kind: Kind
    token_text: TokenText | None = None  # names tokens in logprobs (None: none asked)
    read_calls: ReplyParser | None = None  # chat with tools: how its replies' calls are read
    reasoning: ReasoningParser | None = None  # chat: splits the thoughts from the answer
    token_ids: bool = False  # vLLM's `return_token_ids`: prompt and output token ids too
    prompt_logprobs: int | None = None  # vLLM's field, with this many alternatives (None: none)
    echo: str = ""  # chat: what every choice's content starts with (vLLM's `echo`)
    token_bytes: TokenBytes | None = None  # chat logprobs' `bytes` (None: the text's UTF-8)
    include_reasoning: bool = True  # chat: False leaves the thoughts out (still not content)
    role: str = "assistant"  # chat: the reply's (`ChatCompletionRequest.reply_role`)

    @classmethod
    def of(
        cls,
        req: Prepared,
        model: str,
        kind: Kind,
        response_id: str | None = None,
        token_text: TokenText | None = None,
        read_calls: ReplyParser | None = None,
        reasoning: ReasoningParser | None = None,
        token_ids: bool = False,
        prompt_logprobs: int | None = None,
        echo: str = "",
        token_bytes: TokenBytes | None = None,
        include_reasoning: bool = True,
        role: str = "assistant",
    ) -> ResponseHead:
        """`prompt_logprobs`: what the request asked for in vLLM's field (the engine may score
        the prompt with more alternatives, for an echoed prompt's `logprobs`)."""
        asked = req.params.logprobs is not None or req.params.prompt_logprobs is not None
        names = token_text if asked else None
        arrival = int(req.timings.arrival)
        rid = response_id or req.request_id
        return cls(
            rid, arrival, model, kind, names, read_calls, reasoning, token_ids, prompt_logprobs,
            echo, token_bytes, include_reasoning, role,
        )  # fmt: skip

    def logprobs(
        self, token_ids: Sequence[int], entries: Sequence[Any] | None, text_offset: int = 0
    ) -> dict[str, Any] | None:
        """A choice's `logprobs` for these tokens (None when the request asked for none)."""
        if entries is None or self.token_text is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(token_ids, entries, self.token_text, self.token_bytes)
        return completion_logprobs(token_ids, entries, self.token_text, text_offset)

    def fields(self, chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}


_MESSAGE_FIELDS: dict[str, Any] = {
    "role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
    "function_call": None, "tool_calls": [], "reasoning_content": None,
}  # fmt: skip
"""Every field of a whole chat reply's message, null or empty unless set, in vLLM's order: its
server writes them all (code that reads `message["tool_calls"]` finds a list)."""
_BODY_FIELDS: dict[str, Any] = {"service_tier": None, "system_fingerprint": None}
"""vLLM's whole responses carry these top-level fields as null."""


def full_body(head: ResponseHead, reqs: list[Prepared], usage: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming response: one choice per request, in order."""
    choices = []
    for index, req in enumerate(reqs):
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": req.finish_reason,
            "logprobs": _choice_logprobs(head, req),
        }
        choice["stop_reason"] = req.stop_reason
        if head.kind == "chat":
            choice["message"] = {**_MESSAGE_FIELDS, **reply_message(head, req.text)}
            if head.echo:
                choice["message"]["content"] = head.echo + (choice["message"]["content"] or "")
            if choice["message"].get("tool_calls") and finishes_with_calls(
                head.read_calls, req.finish_reason
            ):
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = (req.echo or "") + req.text
            if (prompt := _prompt_logprobs(head, req)) is not None:
                choice["prompt_logprobs"] = prompt
            if head.token_ids:
                choice["prompt_token_ids"] = req.prompt_token_ids
        if head.token_ids:
            choice["token_ids"] = req.token_ids
        choices.append(choice)
    body = {**head.fields(chunk=False), "choices": choices, **_BODY_FIELDS, "usage": usage}
    if head.kind == "chat":  # (vLLM's place for chat: one prompt)
        body["prompt_logprobs"] = _prompt_logprobs(head, reqs[0])
        if head.token_ids:
            body["prompt_token_ids"] = reqs[0].prompt_token_ids
    return {**body, "tandem_timings": reqs[0].timings.stages_ms()}


def _prompt_logprobs(head: ResponseHead, req: Prepared) -> list[Any] | None:
    """vLLM's `prompt_logprobs` of a request that asks for them, with as many alternatives."""
    k = head.prompt_logprobs
    if k is None or req.prompt_logprobs is None or head.token_text is None:
        return None
    entries = _with_alternatives(req.prompt_logprobs, k)
    return prompt_logprobs_field(req.prompt_token_ids, entries, head.token_text)


def _with_alternatives(entries: Sequence[Any], k: int) -> list[Any]:
    """Prompt entries `(logprob, alternatives, rank)` with their first `k` alternatives."""
    return [e if e is None else (e[0], list(e[1])[:k], *e[2:]) for e in entries]


def reply_message(head: ResponseHead, text: str) -> dict[str, Any]:
    """A chat reply's message: its thoughts apart (with a reasoning parser), then its calls
    read from the rest (with tools)."""
    message: dict[str, Any] = {"role": head.role}
    content: str | None = text
    if head.reasoning is not None:
        message["reasoning_content"], content = head.reasoning.split(text)
        if not head.include_reasoning:
            message["reasoning_content"] = None
    calls: list[dict[str, Any]] = []
    if head.read_calls is not None and content is not None:
        content, calls = head.read_calls(content)
    message["content"] = content
    if calls:
        message["tool_calls"] = calls
    return message


def _choice_logprobs(head: ResponseHead, req: Prepared) -> dict[str, Any] | None:
    """A whole choice's logprobs: with an echoed prompt's, those of its tokens first (with
    `logprobs` alternatives each, as the output's, also when `prompt_logprobs` asked for more)."""
    if req.params.logprobs is None:  # (`prompt_logprobs` alone has a field of its own)
        return None
    if req.echo is not None and req.prompt_logprobs is not None:
        prompt = _with_alternatives(req.prompt_logprobs, req.params.logprobs)
        entries = prompt + list(req.logprobs or ())
        return head.logprobs(req.prompt_token_ids + req.token_ids, entries)
    return head.logprobs(req.token_ids, req.logprobs)


def chunk(
    head: ResponseHead,
    req: Prepared,
    text: str | None,
    finish: str | None,
    *,
    index: int = 0,
    role: bool = False,
    token_ids: Sequence[int] = (),
    logprobs: Sequence[Any] | None = None,
    text_offset: int = 0,
    usage: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
    new_token_ids: Sequence[int] | None = None,
    first: bool = False,
) -> str:
    """One SSE event with one choice's text (chat: a delta, with the role on the first), and
    the logprobs of the tokens it carries when asked (completions' offsets from
    `text_offset`); with `head.token_ids`, the ids of its tokens, and on a choice's `first`
    chunk the prompt's."""
    choice: dict[str, Any] = {
        "index": index,
        "finish_reason": finish,
        "logprobs": head.logprobs(token_ids, logprobs, text_offset),
    }
    if head.kind == "chat":
        delta: dict[str, Any] = {"role": head.role} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            # (whole calls numbered here; a streamed call's deltas carry their own index)
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if finish is not None or head.kind == "completion":  # (vLLM's: null till the end)
        choice["stop_reason"] = req.stop_reason if finish is not None else None
    if head.token_ids:
        choice["token_ids"] = list(new_token_ids or ())
        if first and head.kind == "completion":
            choice["prompt_token_ids"] = req.prompt_token_ids
    data: dict[str, Any] = {**head.fields(chunk=True), "choices": [choice]}
    if head.token_ids and first and head.kind == "chat":
        data["prompt_token_ids"] = req.prompt_token_ids
    if finish is not None:
        data["tandem_timings"] = req.timings.stages_ms()
    if usage is not None:  # (vLLM's `stream_options.continuous_usage_stats`)
        data["usage"] = usage
    return event(data)


def usage_event(head: ResponseHead, usage: dict[str, Any]) -> str:
    """The last data event of a stream with `stream_options.include_usage`: no choices."""
    return event({**head.fields(chunk=True), "choices": [], "usage": usage})


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def merged_usage(reqs: list[Prepared], n: int) -> dict[str, Any]:
    """Usage of a response whose requests are `n` samples of each prompt in turn: each
    prompt's tokens count once (as OpenAI counts them for n > 1), every completion token
    counts, and so does every transferred block."""
    firsts = reqs[::n]
    prompt = sum(len(r.prompt_token_ids) for r in firsts)
    completion = sum(r.completion_tokens for r in reqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in firsts)},
        "kv_transferred_blocks": sum(r.num_transferred_blocks for r in reqs),
    }
