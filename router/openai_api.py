"""OpenAI-compatible responses: JSON bodies and SSE streams for completions and chat.

Streams follow OpenAI: `data: {chunk}` events, an optional usage chunk with empty `choices`
(`stream_options.include_usage`), then `data: [DONE]`. An error after the stream started is
sent as one `data: {"error": ...}` event before `[DONE]`. Every response carries the request's
stage timings: the `x-tandem-timings` header (non-streaming) and a `tandem_timings` field (of
the first choice, when there are several). Behind Ray's HAProxy ingress a stream that waits
writes SSE comments (`sse_keepalive`). Several choices (a batch of prompts, `n` > 1) are
requests of their own, run together (`multi_choice`); one choice takes the direct way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.types import Receive, Scope, Send

from tandem.router import multi_choice
from tandem.router.errors import APIError
from tandem.router.openai_format import (
    Kind,
    ResponseHead,
    chunk,
    event,
    full_body,
    merged_usage,
    reply_message,
    usage_event,
)
from tandem.router.openai_logprobs import text_length
from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.pd_orchestrator import RequestTimings
from tandem.router.prepared import Prepared
from tandem.router.reply_stream import ReplyStream
from tandem.router.serving import Serving
from tandem.router.sse_keepalive import KEEPALIVE, paced
from tandem.router.tool_calls import ReplyParser, finishes_with_calls, template_tools
from tandem.router.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A stream whose body generator is closed as soon as the response ends, also when the
    client left mid-stream (Starlette leaves it to the garbage collector, which may take
    seconds when a traceback cycle holds it): closing it cancels the request on its workers.
    `on_close` runs after that, e.g. for a body that never started (closing it runs nothing)."""

    def __init__(
        self,
        content: AsyncIterator[str],
        *,
        media_type: str,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:
            # Behind Serve's proxy, a client that leaves makes `receive` raise this: the
            # request ends here (closing the body cancels it on its workers), not as an error.
            logger.info("client left during the stream")
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_close is not None:
                    await self.on_close()


class _ErrorJSON(JSONResponse):
    """JSON in ASCII: an error message that quotes the client's text (a model name, a path)
    renders whatever that text holds."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(exc: APIError) -> JSONResponse:
    return _ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)


async def create_completion(serving: Serving, body: CompletionRequest) -> Any:
    arrival = time.time()
    body.check_supported()
    prompts = body.prompts()
    multi_choice.check_count(len(prompts), body.n)
    response_id, fields = f"cmpl-{uuid.uuid4().hex}", body.sampling_dict()

    async def prepare(index: int, request_id: str) -> Prepared:
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
    return await _serve(serving, response_id, count, body.n, prepare, "completion", body)


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest) -> Any:
    arrival = time.time()
    body.check_supported()
    multi_choice.check_count(1, body.n)
    response_id, fields = f"chatcmpl-{uuid.uuid4().hex}", body.sampling_dict()
    messages, max_tokens = body.template_messages(), body.requested_max_tokens()

    def prepare(index: int, request_id: str) -> Awaitable[Prepared]:
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
        )

    read_calls = body.reply_parser(serving.tool_parser)
    if isinstance(read_calls, ToolParser) and read_calls.keeps_specials:
        fields["skip_special_tokens"] = False  # (its call marker is a special token)
    forced = body.forced_tools()
    shown = forced if forced is not None else body.tools if read_calls else None
    tools = template_tools(shown) if shown else None
    return await _serve(serving, response_id, body.n, body.n, prepare, "chat", body, read_calls)


async def _serve(
    serving: Serving,
    response_id: str,
    count: int,
    n: int,
    prepare: Callable[[int, str], Awaitable[Prepared]],
    kind: Kind,
    body: CompletionRequest | ChatCompletionRequest,
    read_calls: ReplyParser | None = None,
) -> JSONResponse | StreamingResponse:
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    # (as vLLM's: usage on every chunk only for a stream that asks for usage at all)
    continuous = bool(options and options.include_usage and options.continuous_usage_stats)
    token_text = _token_id_text if body.return_tokens_as_token_ids else serving.token_text
    reasoning = serving.reasoning_parser if kind == "chat" else None
    ids, asked = body.return_token_ids, body.prompt_logprobs
    echo = body.echoed_text() if isinstance(body, ChatCompletionRequest) else ""
    if count == 1:
        req = await prepare(0, response_id)
        head = ResponseHead.of(
            req, serving.model_name, kind, None, token_text, read_calls, reasoning, ids, asked,
            echo,
        )  # fmt: skip
        if body.stream:
            return ClosingStreamingResponse(
                _sse(serving, req, kind, include_usage, head, continuous),
                media_type="text/event-stream",
                on_close=lambda: serving.abandon(req),  # (nothing to do once `run` started)
            )
        async with contextlib.aclosing(serving.run(req)) as items:
            async for _ in items:
                pass
        return _json(full_body(head, [req], req.usage()))
    reqs = await multi_choice.prepare_all(
        serving, count, lambda i: prepare(i, f"{response_id}-{i}")
    )
    head = ResponseHead.of(
        reqs[0], serving.model_name, kind, response_id, token_text, read_calls, reasoning, ids,
        asked, echo,
    )  # fmt: skip
    if body.stream:
        return ClosingStreamingResponse(
            _sse_choices(serving, head, reqs, n, include_usage, continuous),
            media_type="text/event-stream",
            on_close=lambda: multi_choice.abandon_all(serving, reqs),
        )
    await multi_choice.run_all(serving, reqs)
    return _json(full_body(head, reqs, merged_usage(reqs, n)))


def _json(body: dict[str, Any]) -> JSONResponse:
    timings = json.dumps(body["tandem_timings"], separators=(",", ":"))
    return JSONResponse(body, headers={"x-tandem-timings": timings})


def _sse(
    serving: Serving,
    req: Prepared,
    kind: Kind,
    include_usage: bool,
    head: ResponseHead | None = None,
    continuous: bool = False,
) -> AsyncGenerator[str, None]:
    """One choice's stream (`continuous`: every chunk carries the usage so far)."""
    head = head or ResponseHead.of(req, serving.model_name, kind)
    items = _as_choice_zero(serving.run(req))
    return _events(serving, head, [req], 1, include_usage, continuous, items)


def _sse_choices(
    serving: Serving,
    head: ResponseHead,
    reqs: list[Prepared],
    n: int,
    include_usage: bool,
    continuous: bool = False,
) -> AsyncGenerator[str, None]:
    """Several choices' streams in one, each chunk naming its choice's index."""
    items = multi_choice.merged(serving, reqs)
    return _events(serving, head, reqs, n, include_usage, continuous, items)


async def _as_choice_zero(
    items: AsyncGenerator[dict[str, Any], None],
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    async with contextlib.aclosing(items):
        async for item in items:
            yield 0, item


async def _events(
    serving: Serving,
    head: ResponseHead,
    reqs: list[Prepared],
    n: int,
    include_usage: bool,
    continuous: bool,
    choices: AsyncGenerator[tuple[int, dict[str, Any]], None],
) -> AsyncGenerator[str, None]:
    """The SSE events of `choices` ((choice index, token item) as they come): the chat role
    or the echoed prompt first, a chunk per item with text, logprobs or an end, the usage,
    `[DONE]`; an error as one error event before `[DONE]`. A chat reply's text is split by
    its `ReplyStream` (thoughts apart; with tools, "auto", the content before a call as it
    comes, then each call as it is written); a forced call goes in one chunk at the end."""
    offsets = _Offsets(head)
    parser = head.read_calls if isinstance(head.read_calls, ToolParser) else None
    split = head.kind == "chat" and (parser is not None or head.reasoning is not None)
    replies: dict[int, ReplyStream] = {}
    emitted = 0  # completion tokens sent so far, all choices (they may run ahead)
    held_ids: dict[int, list[int]] = {}  # (`return_token_ids`: those of text held back)
    started: set[int] = set()  # choices whose first chunk went out
    try:
        usage = _so_far(merged_usage(reqs, n), 0) if continuous else None
        for index, req in enumerate(reqs):
            if head.kind == "chat":
                yield chunk(head, req, "", None, index=index, role=True, first=True, usage=usage)
                if head.echo:
                    yield chunk(head, req, head.echo, None, index=index, usage=usage)
                started.add(index)
            elif req.echo:
                yield chunk(head, req, req.echo, None, index=index, first=True, usage=usage)
                started.add(index)
        every_s = serving.sse_keepalive_s
        items = choices if every_s is None else paced(choices, every_s)
        async with contextlib.aclosing(items):
            async for entry in items:
                if entry is None:
                    yield KEEPALIVE
                    continue
                index, item = entry
                emitted += len(item["token_ids"])
                finish = item.get("finish_reason")
                reasoning, calls = "", list[dict[str, Any]]()
                if head.read_calls is not None and parser is None:  # a forced call: whole
                    if finish is not None:
                        for event_text in from_reply(head, reqs[index], index, finish):
                            yield event_text
                    continue
                if head.token_ids:
                    held_ids.setdefault(index, []).extend(item["token_ids"])
                if split:
                    reply = replies.setdefault(index, ReplyStream(head.reasoning, parser))
                    reasoning, content, calls = reply.feed(item["text"], finish is not None)
                    item = {**item, "text": content}
                    finish = "tool_calls" if finish is not None and reply.has_calls else finish
                if (
                    item["text"]
                    or reasoning
                    or calls
                    or finish is not None
                    or offsets.has_logprobs(item)
                ):
                    text = item["text"] or None
                    logprobs = offsets.take(index, item)
                    usage = _so_far(merged_usage(reqs, n), emitted) if continuous else None
                    req = reqs[index]
                    # (calls and the finish reason in one chunk: the `openai` client's stream
                    # helper then never ends the calls; OpenAI sends the finish alone)
                    last_call = calls and finish is not None
                    yield chunk(
                        head,
                        req,
                        text,
                        None if last_call else finish,
                        index=index,
                        usage=usage,
                        tool_calls=calls or None,
                        reasoning=reasoning,
                        new_token_ids=held_ids.pop(index, None),
                        first=index not in started,
                        **logprobs,
                    )
                    if last_call:
                        yield chunk(head, req, None, finish, index=index, usage=usage)
                    started.add(index)
        if include_usage:
            yield usage_event(head, merged_usage(reqs, n))
    except APIError as exc:
        yield event(exc.body())
    yield DONE


def from_reply(head: ResponseHead, req: Prepared, index: int, finish: str) -> Iterator[str]:
    """The chunks of a forced call's reply: its call (or content), then its finish reason
    alone, as OpenAI sends them (the `openai` client's stream helper ends a call only so)."""
    message = reply_message(head, req.text)
    calls = message.get("tool_calls")
    finish = "tool_calls" if calls and finishes_with_calls(head.read_calls, finish) else finish
    yield chunk(
        head,
        req,
        message["content"],
        None if calls else finish,
        index=index,
        tool_calls=calls,
        new_token_ids=req.token_ids,
    )
    if calls:
        yield chunk(head, req, None, finish, index=index)


def _so_far(usage: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
    """`usage` counting the completion tokens sent so far (the choices may have run ahead)."""
    total = usage["prompt_tokens"] + completion_tokens
    return {**usage, "completion_tokens": completion_tokens, "total_tokens": total}


class _Offsets:
    """A stream's logprobs per chunk, and where each choice's `text_offset` has got to."""

    def __init__(self, head: ResponseHead) -> None:
        self.token_text = head.token_text
        self.offsets: dict[int, int] = {}

    def has_logprobs(self, item: dict[str, Any]) -> bool:
        return self.token_text is not None and bool(item.get("logprobs"))

    def take(self, index: int, item: dict[str, Any]) -> dict[str, Any]:
        """`chunk`'s logprob arguments for `item`, moving the choice's offset past it."""
        if self.token_text is None or item.get("logprobs") is None:
            return {}
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + text_length(item["token_ids"], self.token_text)
        return {"token_ids": item["token_ids"], "logprobs": item["logprobs"], "text_offset": offset}


def _token_id_text(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` name of a token in logprobs: unique, whatever its
    text (byte tokens that decode alone to U+FFFD would share a key in `top_logprobs`)."""
    return f"token_id:{token_id}"
