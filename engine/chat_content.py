"""A chat message's content as the one string chat templates take.

OpenAI lets `content` be a list of parts (`[{"type": "text", "text": ...}, ...]`). Only text
parts are supported; they are joined with a newline, as vLLM joins them for templates that take
a string. Shared by `LLM.chat` and the router's chat API.
"""

from __future__ import annotations

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
