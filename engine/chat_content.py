"""A chat message as chat templates take it.

OpenAI lets `content` be a list of parts (`[{"type": "text", "text": ...}, ...]`). Only text
parts are supported; they are joined with a newline, as vLLM joins them for templates that take
a string. An assistant's `tool_calls` carry their `arguments` as the object they encode (OpenAI
sends JSON text). Shared by `LLM.chat` and the router's chat API.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

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
        if kind != "text":
            raise InvalidRequestError(f"content parts of type {kind!r} are not supported", param)
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError("a content part of type 'text' needs a 'text' string", param)
        texts.append(text)
    return "\n".join(texts)


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
