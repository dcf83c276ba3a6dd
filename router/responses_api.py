"""`POST /v1/responses`: OpenAI's Responses API, answered as a chat completion.

`responses_protocol.ResponsesRequest` becomes a chat request; this module runs it through the
chat API (`openai_api.create_chat_completion`: the same routing, tool calls, reasoning split and
structured output) and writes the answer as a Response: `output` holds a `reasoning` item (with
a reasoning parser), a `message` item with its `output_text`, and a `function_call` item per
tool call; `usage` counts input and output tokens; `status` is `incomplete` (reason
`max_output_tokens`) when the length limit ended it. Streamed, the chat chunks become the
Responses events in order (`response.created`, `response.in_progress`, per item
`response.output_item.added` ... `.done`, text and argument deltas, `response.completed` or
`response.incomplete`), each with its `sequence_number`; an error mid-stream is an `error` event
and `response.failed`. A client that leaves cancels the request as a chat stream's would.
A response that completed (or ended incomplete) is kept unless `store` is false
(`responses_store.py`), for `GET /v1/responses/{id}` and `previous_response_id`.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse

from tandem.router.errors import APIError
from tandem.router.openai_api import create_chat_completion
from tandem.router.openai_stream import ClosingStreamingResponse
from tandem.router.responses_protocol import ResponsesRequest
from tandem.router.responses_store import ResponsesStore
from tandem.router.serving import Serving

CHAT_FIELD_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}
"""The Responses API's names of the chat fields a request becomes, for its error replies."""


async def create_response(serving: Serving, body: ResponsesRequest, store: ResponsesStore) -> Any:
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id, "previous_response_id").conversation()
    chat = body.chat_request(history)
    try:
        answer = await create_chat_completion(serving, chat)
    except APIError as exc:
        if (name := CHAT_FIELD_NAMES.get(exc.param or "")) is not None:
            exc.message = exc.message.replace(str(exc.param), name)
            exc.param = name
        raise
    keep = store.capacity > 0 and body.store is not False
    head = _Head(body, serving.model_name, stored=keep)

    def stored(response: dict[str, Any]) -> None:
        if keep:
            store.put(response, [*history, *body.input_items()])

    if not isinstance(answer, ClosingStreamingResponse):
        data = json.loads(bytes(answer.body))
        headers = {"x-tandem-timings": answer.headers.get("x-tandem-timings", "{}")}
        response = head.from_chat(data)
        stored(response)
        return JSONResponse(response, headers=headers)
    return ClosingStreamingResponse(
        _events(head, answer.body_iterator, stored),  # type: ignore[arg-type]
        media_type="text/event-stream",
        on_close=answer.on_close,
    )


class _Head:
    """What every Response object of one request repeats: id, time, the request's settings."""

    def __init__(self, body: ResponsesRequest, model: str, stored: bool) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.settings = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_logprobs": body.top_logprobs,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {},
            "user": body.user,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "truncation": body.truncation or "disabled",
            "store": stored,
        }

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete,
            "output": output,
            "usage": _usage(usage) if usage else None,
            **self.settings,
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response of a finished (non-streamed) chat completion."""
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not (calls or output):  # (as streamed: no empty message
            # after thoughts alone)
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            output.append(_message_item(_new_id("msg"), message.get("content") or "", logprobs))
        for call in calls:
            output.append(_call_item(_new_id("fc"), call["id"], call["function"]))
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        output[-1]["status"] = status  # (the item the token limit cut)
        return self.response(status, output, chat.get("usage"))


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(
    item_id: str, text: str | None, logprobs: list[dict[str, Any]], status: str = "completed"
) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": content}  # fmt: skip


def _call_item(
    item_id: str, call_id: str, function: dict[str, Any], status: str = "completed"
) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id,
            "name": function.get("name") or "", "arguments": function.get("arguments") or "",
            "status": status}  # fmt: skip


async def _chat_chunks(sse: AsyncIterator[str]) -> AsyncGenerator[dict[str, Any], None]:
    """The JSON of each `data:` event of a chat SSE stream (comments and `[DONE]` skipped)."""
    async for event in sse:
        for line in event.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def _events(
    head: _Head, sse: AsyncIterator[str], on_done: Callable[[dict[str, Any]], None]
) -> AsyncGenerator[str, None]:
    """The Responses events of a chat stream; `on_done` gets the final response of one that
    completed (or ended incomplete), before its last event goes."""
    writer = _EventWriter(head)
    async with contextlib.aclosing(sse):  # type: ignore[type-var]
        yield writer.event("response.created", response=head.response("in_progress", []))
        yield writer.event("response.in_progress", response=head.response("in_progress", []))
        async for chunk in _chat_chunks(sse):
            for event in writer.on_chunk(chunk):
                yield event
        events = writer.finish()
        if writer.final is not None and writer.final["status"] != "failed":
            on_done(writer.final)
        for event in events:
            yield event


class _EventWriter:
    """Turns chat chunks into Responses events, keeping the output items open so far."""

    def __init__(self, head: _Head) -> None:
        self.head = head
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (last of output)
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None  # the response `finish` ended with

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event, written now (items it names may change afterwards)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def on_chunk(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:
            self.error = chunk["error"]
            return []
        self.usage = chunk.get("usage") or self.usage
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"], [])
            if delta.get("content"):
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                out += self._text("message", delta["content"], logprobs)
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _index(self) -> int:
        return len(self.output) - 1

    def _text(self, kind: str, delta: str, logprobs: list[dict[str, Any]]) -> list[str]:
        """`delta` of a reasoning or message item's text, opening one unless it is open."""
        item = self.open
        out = [] if item is not None and item["type"] == kind else self._open_text(kind)
        item = self.open
        assert item is not None
        part = item["content"][0]
        part["text"] += delta
        where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        if kind == "message":
            part["logprobs"] += logprobs
            out.append(self.event("response.output_text.delta", **where, delta=delta,
                                  logprobs=logprobs))  # fmt: skip
        else:
            out.append(self.event("response.reasoning_text.delta", **where, delta=delta))
        return out

    def _open_text(self, kind: str) -> list[str]:
        """Closes the open item and opens a reasoning or message item with an empty text part."""
        out = self._close()
        if kind == "reasoning":
            item = _reasoning_item(_new_id("rs"), "", "in_progress")
        else:
            item = _message_item(_new_id("msg"), None, [], "in_progress")
        self.output.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=self._index(),
                              item=item))  # fmt: skip
        part = _text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        item["content"] = [part]
        out.append(self.event("response.content_part.added", item_id=item["id"],
                              output_index=self._index(), content_index=0, part=part))  # fmt: skip
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self._close()
            item = _call_item(_new_id("fc"), str(call.get("id") or _new_id("call")),
                              {"name": function.get("name")}, "in_progress")  # fmt: skip
            self.calls[index] = item
            self.output.append(item)
            self.open = item
            out.append(self.event("response.output_item.added", output_index=self._index(),
                                  item=item))  # fmt: skip
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.output.index(item),
                                  delta=function["arguments"]))  # fmt: skip
        return out

    def _close(self, status: str = "completed") -> list[str]:
        """Ends the open item: its `.done` events, with `status` (incomplete: the token limit
        cut it)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        out: list[str] = []
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self.event("response.output_text.done", **where, text=part["text"],
                                  logprobs=part["logprobs"]))  # fmt: skip
            out.append(self.event("response.content_part.done", **where, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self.event("response.reasoning_text.done", **where, text=part["text"]))
            out.append(self.event("response.content_part.done", **where, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"]))  # fmt: skip
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(self) -> list[str]:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        out = self._close(status)  # (every other item was closed when the next one opened)
        if self.error is not None:
            error = {"code": self.error.get("code"), "message": self.error.get("message")}
            out.append(self.event("error", **error, param=self.error.get("param")))
            # (the response's error code is one of OpenAI's: ours stays in the error event)
            limited = self.error.get("type") == "rate_limit_error"
            failed = {**error, "code": "rate_limit_exceeded" if limited else "server_error"}
            self.final = self.head.response("failed", self.output, self.usage, failed)
            return [*out, self.event("response.failed", response=self.final)]
        if not self.output:  # an empty reply: an empty message, as a non-streamed one has
            out += self._open_text("message") + self._close(status)
        self.final = self.head.response(status, self.output, self.usage)
        return [*out, self.event(f"response.{status}", response=self.final)]
