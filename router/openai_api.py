"""OpenAI-compatible responses: JSON bodies and SSE streams (`openai_stream`) for completions
and chat. Every response carries the request's stage timings: the `x-tandem-timings` header
(non-streaming) and a `tandem_timings` field (of the first choice, when there are several);
an error answered instead carries the header too, `{"e2e": ms}` from arrival to the refusal.
Behind Ray's HAProxy ingress a stream that waits writes SSE comments (`sse_keepalive`).
Several choices (a batch of prompts, `n` > 1) are requests of their own, run together
(`multi_choice`); one choice takes the direct way.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.router import multi_choice
from tandem.router.errors import APIError, bad_request
from tandem.router.openai_format import (
    Kind,
    ResponseHead,
    full_body,
    merged_usage,
)
from tandem.router.openai_protocol import (
    MAX_CLIENT_ID,
    ChatCompletionRequest,
    CompletionRequest,
)
from tandem.router.openai_stream import ClosingStreamingResponse, sse, sse_choices
from tandem.router.prepared import Prepared
from tandem.router.request_prep import sampling_fields
from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving, run_to_end
from tandem.router.sibling_load import SiblingPlans
from tandem.router.tool_calls import ReplyParser, template_tools
from tandem.router.tool_parsers import ToolParser


class _ErrorJSON(JSONResponse):
    """JSON in ASCII: an error message that quotes the client's text (a model name, a path)
    renders whatever that text holds."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(exc: APIError) -> JSONResponse:
    return _ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _timed_errors(create: Callable[_P, Awaitable[_R]]) -> Callable[_P, Awaitable[_R]]:
    """`create`, whose APIErrors (a refusal at admission above all) carry `x-tandem-timings`
    with the time from arrival to the refusal, so that "refused at once" can be told apart
    from "refused after waiting" whatever lies between the client and the router."""

    @functools.wraps(create)
    async def timed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        arrival = time.time()
        try:
            return await create(*args, **kwargs)
        except APIError as exc:
            e2e = {"e2e": round((time.time() - arrival) * 1000, 3)}
            exc.headers = {**(exc.headers or {}), "x-tandem-timings": json.dumps(e2e)}
            raise

    return timed


@dataclass(frozen=True)
class ResponseIds:
    """A response's id and the base of its requests' ids on the workers. (`X-Request-Id`
    comes back as a response header: Serve's proxy sends it back, and `direct_http` does.)"""

    response: str
    requests: str

    @classmethod
    def new(cls, prefix: str, client_id: str | None) -> ResponseIds:
        """`prefix` and a new uuid, or the client's `X-Request-Id` (as vLLM takes it:
        `chatcmpl-<X-Request-Id>`), whose requests still get ids of their own (a client may
        send one id twice at once)."""
        fresh = uuid.uuid4().hex
        if client_id is None:
            return cls(f"{prefix}-{fresh}", f"{prefix}-{fresh}")
        if not client_id or len(client_id) > MAX_CLIENT_ID:
            raise bad_request(
                f"X-Request-Id must be 1 to {MAX_CLIENT_ID} characters, got {len(client_id)}",
                "x-request-id",
            )
        return cls(f"{prefix}-{client_id}", f"{prefix}-{client_id}-{fresh[:12]}")


@_timed_errors
async def create_completion(
    serving: Serving, body: CompletionRequest, client_id: str | None = None
) -> Any:
    arrival = time.time()
    body.check_supported()
    prompts = body.prompts()
    multi_choice.check_count(len(prompts), body.n)
    ids, fields = ResponseIds.new("cmpl", client_id), await sampling_fields(body)

    async def prepare(
        index: int, request_id: str, siblings: SiblingPlans | None = None
    ) -> Prepared:
        try:
            req = await serving.prepare(
                request_id,
                body.model,
                prompts[index // body.n],
                1 if body.prompt_only else body.max_tokens,
                multi_choice.sample_fields(fields, index % body.n),
                RequestTimings(arrival),
                deadline_ms=body.deadline_ms,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                priority=body.priority,
                user=body.user,
                add_special_tokens=body.add_special_tokens,
                siblings=siblings,
            )
        except APIError as exc:
            if len(prompts) > 1:  # say which prompt of the batch
                exc.message = f"prompt {index // body.n}: {exc.message}"
            raise
        if body.echo:  # (the prompt the model saw: a truncated one's text is that of its tail)
            prompt = prompts[index // body.n]
            whole = body.truncate_prompt_tokens is None
            req.echo = (
                prompt
                if isinstance(prompt, str) and whole
                else serving.prompt_text(req.prompt_token_ids)
            )
            req.prompt_only = body.prompt_only
        return req

    count = len(prompts) * body.n
    return await _serve(serving, ids, count, body.n, prepare, "completion", body)


@_timed_errors
async def create_chat_completion(
    serving: Serving, body: ChatCompletionRequest, client_id: str | None = None
) -> Any:
    arrival = time.time()
    body.check_supported()
    multi_choice.check_count(1, body.n)
    ids, fields = ResponseIds.new("chatcmpl", client_id), await sampling_fields(body)
    messages, max_tokens = body.template_messages(), body.requested_max_tokens()

    def prepare(
        index: int, request_id: str, siblings: SiblingPlans | None = None
    ) -> Awaitable[Prepared]:
        return serving.prepare(
            request_id,
            body.model,
            messages,
            max_tokens,
            multi_choice.sample_fields(fields, index),
            RequestTimings(arrival),
            deadline_ms=body.deadline_ms,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            priority=body.priority,
            user=body.user,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
            tools=tools,
            documents=body.documents,
            add_special_tokens=body.add_special_tokens,
            siblings=siblings,
        )

    read_calls = body.reply_parser(serving.tool_parser)
    if isinstance(read_calls, ToolParser) and read_calls.keeps_specials:
        fields["skip_special_tokens"] = False  # (its call marker is a special token)
    # (every tool goes to the template, whatever `tool_choice` says, as vLLM shows them: the
    # prompt is the same, and so are its prompt_tokens)
    tools = template_tools(body.tools) if body.tools else None
    return await _serve(serving, ids, body.n, body.n, prepare, "chat", body, read_calls)


async def _serve(
    serving: Serving,
    response_ids: ResponseIds,
    count: int,
    n: int,
    prepare: Callable[[int, str, SiblingPlans | None], Awaitable[Prepared]],
    kind: Kind,
    body: CompletionRequest | ChatCompletionRequest,
    read_calls: ReplyParser | None = None,
) -> JSONResponse | StreamingResponse:
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    # (as vLLM's: usage on every chunk only for a stream that asks for usage at all)
    continuous = bool(options and options.include_usage and options.continuous_usage_stats)
    token_text = _token_id_text if body.return_tokens_as_token_ids else serving.token_text
    ids, asked = body.return_token_ids, body.prompt_logprobs_field()
    echo, role, thoughts = "", "assistant", True
    if isinstance(body, ChatCompletionRequest):
        echo, role, thoughts = body.echoed_text(), body.reply_role(), body.include_reasoning
    response_id, base = response_ids.response, response_ids.requests
    if count == 1:
        req = await prepare(0, base, None)
        reasoning = serving.reasoning_after(req.prompt_token_ids) if kind == "chat" else None
        head = ResponseHead.of(
            req, serving.model_name, kind, response_id, token_text, read_calls, reasoning, ids,
            asked, echo, serving.token_bytes, thoughts, role,
        )  # fmt: skip
        if body.stream:
            return ClosingStreamingResponse(
                sse(serving, req, kind, include_usage, head, continuous),
                media_type="text/event-stream",
                on_close=lambda: serving.abandon(req),  # (nothing to do once `run` started)
            )
        await run_to_end(serving, req)
        return _json(full_body(head, [req], req.usage()))
    reqs = await multi_choice.prepare_all(
        serving, count, lambda i, siblings: prepare(i, f"{base}-{i}", siblings)
    )
    reasoning = serving.reasoning_after(reqs[0].prompt_token_ids) if kind == "chat" else None
    head = ResponseHead.of(
        reqs[0], serving.model_name, kind, response_id, token_text, read_calls, reasoning, ids,
        asked, echo, serving.token_bytes, thoughts, role,
    )  # fmt: skip
    if body.stream:
        return ClosingStreamingResponse(
            sse_choices(serving, head, reqs, n, include_usage, continuous),
            media_type="text/event-stream",
            on_close=lambda: multi_choice.abandon_all(serving, reqs),
        )
    await multi_choice.run_all(serving, reqs)
    return _json(full_body(head, reqs, merged_usage(reqs, n)))


def _json(body: dict[str, Any]) -> JSONResponse:
    timings = json.dumps(body["tandem_timings"], separators=(",", ":"))
    return JSONResponse(body, headers={"x-tandem-timings": timings})


def _token_id_text(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` name of a token in logprobs: unique, whatever its
    text (byte tokens that decode alone to U+FFFD would share a key in `top_logprobs`)."""
    return f"token_id:{token_id}"
