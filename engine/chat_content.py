"""A chat message as chat templates take it.

OpenAI lets `content` be a list of parts (`[{"type": "text", "text": ...}, ...]`). Only text
parts are supported (`refusal` and `input_text` ones as text); they are joined with a newline,
as vLLM joins them for templates that take a string. An assistant's `tool_calls` carry their
`arguments` as the object they encode (OpenAI sends JSON text). For Mistral's templates,
tool-call ids are 9 letters and digits (`nine_character_call_ids`). Shared by `LLM.chat` and
the router's chat API.
"""

from __future__ import annotations

import contextlib
import json
import re
import string
from collections.abc import Iterable, Mapping
from typing import Any

import xxhash

from tandem.engine.errors import InvalidRequestError


def content_text(content: str | Iterable[Mapping[str, Any]] | None, param: str = "messages") -> str:
    """`content` as one string (None: ""); parts other than text raise InvalidRequestError."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        key = _TEXT_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise InvalidRequestError(f"content parts of type {kind!r} are not supported", param)
        text = part.get(key)
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"a content part of type {kind!r} needs a {key!r} string", param
            )
        texts.append(text)
    return "\n".join(texts)


_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}  # fmt: skip
"""The content parts taken as text, as vLLM takes them (OpenAI's assistant `refusal`, the
Responses API's `input_text` / `output_text`, a `thinking` part), and where each keeps its
text."""


def template_tool_calls(calls: Any) -> Any:
    """An assistant message's `tool_calls` as chat templates take them: each call's
    `arguments` (OpenAI's JSON text) as the object it encodes, as transformers documents them
    and vLLM passes them (Llama 3.1's, Qwen2.5's and Mistral's templates write `arguments |
    tojson`: text would show the model a quoted string); empty arguments as {}. Text that is
    not JSON stays as it is, for the template to render or refuse."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or isinstance(function.get("arguments"), dict):
            out.append(call)
            continue
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


_NINE = re.compile(r"[A-Za-z0-9]{9}")
_BASE62 = string.digits + string.ascii_letters


def nine_character_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each tool-call id that is not 9 letters and digits (OpenAI's `call_...`,
    this server's) replaced by 9 derived from it, the same for a call and the tool message
    that answers it: Mistral's chat templates refuse any other id (`[TOOL_CALLS]`; vLLM
    shortens the ids it gives Mistral models so too)."""

    def short(call_id: Any) -> Any:
        if not isinstance(call_id, str) or _NINE.fullmatch(call_id):
            return call_id
        n, digits = xxhash.xxh64_intdigest(call_id.encode()), []
        for _ in range(9):
            n, digit = divmod(n, 62)
            digits.append(_BASE62[digit])
        return "".join(digits)

    out = []
    for message in messages:
        message = dict(message)
        if "tool_call_id" in message:
            message["tool_call_id"] = short(message["tool_call_id"])
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [
                {**c, "id": short(c["id"])} if isinstance(c, dict) and "id" in c else c
                for c in calls
            ]
        out.append(message)
    return out
