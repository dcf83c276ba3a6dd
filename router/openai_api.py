"""OpenAI-compatible responses: JSON bodies and SSE streams for completions and chat.

Streams follow OpenAI: `data: {chunk}` events, an optional usage chunk with empty `choices`
(`stream_options.include_usage`), then `data: [DONE]`. An error after the stream started is
sent as one `data: {"error": ...}` event before `[DONE]`. Every response carries the request's
stage timings: the `x-tandem-timings` header (non-streaming) and a `tandem_timings` field.

Behind Ray's HAProxy ingress (`Serving.sse_keepalive_s` set) a stream that waits (a long
prefill, a queue) writes an SSE comment (`: keep-alive`) every `KEEPALIVE_S`: HAProxy notices a
client that left only when the response writes, and without them a client leaving during
prefill was seen at the first token, the prefill running to its end. Behind Serve's proxy, which
passes a disconnect on at once, no comment is written: clients that parse every line as JSON
(as `vllm bench serve`'s does) would fail on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.types import Receive, Scope, Send

from tandem.router.errors import APIError
from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.pd_orchestrator import RequestTimings
from tandem.router.prepared import Prepared
from tandem.router.serving import Serving

logger = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]

KEEPALIVE_S = 0.25
"""Behind HAProxy, a waiting stream writes an SSE comment this often (seconds)."""
KEEPALIVE = ": keep-alive\n\n"


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


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def create_completion(serving: Serving, body: CompletionRequest) -> Any:
    timings = RequestTimings()
    body.check_supported()
    req = await serving.prepare(
        f"cmpl-{uuid.uuid4().hex}",
        body.model,
        body.single_prompt(),
        body.max_tokens,
        body.sampling_dict(),
        timings,
        deadline_ms=body.deadline_ms,
        priority=body.priority,
        user=body.user,
    )
    return await _respond(serving, req, "completion", body.stream, body.stream_options)


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest) -> Any:
    timings = RequestTimings()
    body.check_supported()
    max_tokens = body.requested_max_tokens()
    req = await serving.prepare(
        f"chatcmpl-{uuid.uuid4().hex}",
        body.model,
        body.template_messages(),
        max_tokens,
        body.sampling_dict(),
        timings,
        deadline_ms=body.deadline_ms,
        priority=body.priority,
        user=body.user,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    return await _respond(serving, req, "chat", body.stream, body.stream_options)


async def _respond(
    serving: Serving, req: Prepared, kind: Kind, stream: bool, options: Any
) -> JSONResponse | StreamingResponse:
    if stream:
        include_usage = bool(options and options.include_usage)
        return ClosingStreamingResponse(
            _sse(serving, req, kind, include_usage),
            media_type="text/event-stream",
            on_close=lambda: serving.abandon(req),  # (nothing to do once `run` started)
        )
    async with contextlib.aclosing(serving.run(req)) as items:
        async for _ in items:
            pass
    body = _full_body(serving.model_name, req, kind)
    timings = req.timings.stages_ms()
    return JSONResponse(
        body, headers={"x-tandem-timings": json.dumps(timings, separators=(",", ":"))}
    )


def _full_body(model: str, req: Prepared, kind: Kind) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None}
    choice["stop_reason"] = req.stop_reason
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": req.text}
    else:
        choice["text"] = req.text
    return {
        "id": req.request_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(req.timings.arrival),
        "model": model,
        "choices": [choice],
        "usage": req.usage(),
        "tandem_timings": req.timings.stages_ms(),
    }


def _chunk(
    model: str, req: Prepared, kind: Kind, text: str | None, finish: str | None, role: bool = False
) -> str:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if finish is not None:
        choice["stop_reason"] = req.stop_reason
    data: dict[str, Any] = {
        "id": req.request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": int(req.timings.arrival),
        "model": model,
        "choices": [choice],
    }
    if finish is not None:
        data["tandem_timings"] = req.timings.stages_ms()
    return _event(data)


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse(
    serving: Serving, req: Prepared, kind: Kind, include_usage: bool
) -> AsyncGenerator[str, None]:
    model = serving.model_name
    try:
        if kind == "chat":
            yield _chunk(model, req, kind, "", None, role=True)
        every_s = serving.sse_keepalive_s
        run = serving.run(req)
        paced = run if every_s is None else _paced(run, every_s)
        async with contextlib.aclosing(paced) as items:
            async for item in items:
                if item is None:
                    yield KEEPALIVE
                    continue
                finish = item.get("finish_reason")
                if item["text"] or finish is not None:
                    yield _chunk(model, req, kind, item["text"] or None, finish)
        if include_usage:
            yield _event(
                {
                    "id": req.request_id,
                    "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "created": int(req.timings.arrival),
                    "model": model,
                    "choices": [],
                    "usage": req.usage(),
                }
            )
    except APIError as exc:
        yield _event(exc.body())
    yield "data: [DONE]\n\n"


async def _paced(
    items: AsyncGenerator[dict[str, Any], None], every_s: float
) -> AsyncGenerator[dict[str, Any] | None, None]:
    """`items`, and None whenever `every_s` pass without one. One task drives `items` from
    start to end (its timeouts stay bound to it); closing this cancels that task."""
    queue: asyncio.Queue[tuple[dict[str, Any] | None, BaseException | None]] = asyncio.Queue()

    async def drive() -> None:
        try:
            async with contextlib.aclosing(items):
                async for item in items:
                    queue.put_nowait((item, None))
        except Exception as exc:  # (APIError, ...) raised where the caller reads
            queue.put_nowait((None, exc))
            return
        queue.put_nowait((None, None))

    driver = asyncio.create_task(drive())
    try:
        while True:
            try:
                async with asyncio.timeout(every_s):
                    item, error = await queue.get()
            except TimeoutError:
                yield None
                continue
            if error is not None:
                raise error
            if item is None:
                return
            yield item
    finally:
        driver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await driver


def model_card(model: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "tandem",
        "root": model,
        "max_model_len": max_model_len,
    }


def models_body(model: str, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, max_model_len)]}
