"""SSE streams of completions and chat: `data: {chunk}` events, an optional usage chunk with
empty `choices` (`stream_options.include_usage`), then `data: [DONE]`; an error after the stream
started as one `data: {"error": ...}` event before `[DONE]`. One choice's stream (`sse`), or
several choices' merged (`sse_choices`, a batch of prompts or `n` > 1)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.types import Receive, Scope, Send

from tandem.router import multi_choice
from tandem.router.errors import APIError
from tandem.router.openai_format import (
    Kind,
    ResponseHead,
    chunk,
    event,
    merged_usage,
    reply_message,
    usage_event,
)
from tandem.router.openai_logprobs import text_length
from tandem.router.prepared import Prepared
from tandem.router.reply_stream import ReplyStream
from tandem.router.serving import Serving
from tandem.router.sse_keepalive import KEEPALIVE, paced
from tandem.router.tool_calls import finishes_with_calls
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


def sse(
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


def sse_choices(
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
    comes, then each call as it is written); a forced call goes in one chunk at the end, after
    the model's thoughts as they came."""
    offsets = _Offsets(head)
    parser = head.read_calls if isinstance(head.read_calls, ToolParser) else None
    split = head.kind == "chat" and (parser is not None or head.reasoning is not None)
    replies: dict[int, ReplyStream] = {}
    emitted: dict[int, int] = {}  # completion tokens sent so far, per choice
    held_ids: dict[int, list[int]] = {}  # (`return_token_ids`: those of text held back)
    started: set[int] = set()  # choices whose first chunk went out
    try:
        for index, req in enumerate(reqs):
            usage = _so_far(req, 0) if continuous else None
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
                emitted[index] = emitted.get(index, 0) + len(item["token_ids"])
                usage = _so_far(reqs[index], emitted[index]) if continuous else None
                finish = item.get("finish_reason")
                reasoning, calls = "", list[dict[str, Any]]()
                if head.read_calls is not None and parser is None:  # a forced call: whole
                    if head.reasoning is not None:  # (its thoughts as they come, as vLLM's)
                        thinking = replies.setdefault(index, ReplyStream(head.reasoning, None))
                        thought = thinking.feed(item["text"], finish is not None)[0]
                        if thought and head.include_reasoning:
                            yield chunk(
                                head, reqs[index], None, None, index=index, usage=usage,
                                reasoning=thought, first=index not in started,
                            )  # fmt: skip
                            started.add(index)
                    if finish is not None:
                        for event_text in from_reply(head, reqs[index], index, finish, usage):
                            yield event_text
                    continue
                if head.token_ids:
                    held_ids.setdefault(index, []).extend(item["token_ids"])
                if split:
                    reply = replies.setdefault(index, ReplyStream(head.reasoning, parser))
                    reasoning, content, calls = reply.feed(
                        item["text"], finish is not None, cut=finish == "length"
                    )
                    reasoning = reasoning if head.include_reasoning else ""
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


def from_reply(
    head: ResponseHead,
    req: Prepared,
    index: int,
    finish: str,
    usage: dict[str, Any] | None = None,
) -> Iterator[str]:
    """The chunks of a forced call's reply: its call (or content) with every token's logprobs
    when asked, then its finish reason alone, as OpenAI sends them (the `openai` client's
    stream helper ends a call only so); `usage` on both (`continuous_usage_stats`)."""
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
        token_ids=req.token_ids,
        logprobs=req.logprobs,
        usage=usage,
    )
    if calls:
        yield chunk(head, req, None, finish, index=index, usage=usage)


def _so_far(req: Prepared, completion_tokens: int) -> dict[str, Any]:
    """One choice's usage with the completion tokens it sent so far (vLLM's
    `continuous_usage_stats`: each chunk counts its own choice's)."""
    usage = merged_usage([req], 1)
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
