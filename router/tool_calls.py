"""Function calling: the tools go to the chat template, and the reply's calls come back as
OpenAI's `tool_calls` (finish reason "tool_calls").

- `tool_choice` "required" or a named function: the output is constrained (structured output,
  `engine/guided.py`) to one JSON object `{"name": <a tool's name>, "arguments": <that tool's
  parameters>}`.
- "auto" (OpenAI's default with tools): the model decides. Its calls are read in the Hermes
  format, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, which Qwen2.5, Qwen3 and
  Hermes chat templates teach their models; text outside the tags is the message's content. A
  model that writes calls in another format gets its text back as content. Streamed, the
  content goes out as it comes until a call may begin (`CallStream`); the calls follow in the
  last chunk.
- "none", or no tools: plain chat.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.router.errors import bad_request


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionSpec


def forced_tools(tools: list[ToolSpec] | None, tool_choice: Any) -> list[ToolSpec] | None:
    """The tools one of which the output must call (None: free output). 400 for a choice that
    cannot be served."""
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        return None
    if not tools:
        raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "required":
        return tools
    name = _named(tool_choice)
    chosen = [t for t in tools if t.function.name == name]
    if not chosen:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return chosen[:1]


def _named(tool_choice: Any) -> str:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return name
    raise bad_request(
        f"tool_choice {tool_choice!r} is not one of none, required, or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def call_schema(tools: list[ToolSpec]) -> dict[str, Any]:
    """The JSON schema of one call of one of `tools`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def template_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (transformers' `tools=`)."""
    return [t.model_dump(exclude_none=True) for t in tools]


ReplyParser = Callable[[str], tuple[str | None, list[dict[str, Any]]]]
"""A reply's text -> (its content, its `tool_calls`)."""


def reply_parser(tools: list[ToolSpec] | None, tool_choice: Any) -> ReplyParser | None:
    """How to read the reply's calls (None: plain text)."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        return hermes_calls
    return forced_call


def forced_call(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A constrained reply: one call (or, cut short, its text as content)."""
    call = tool_call(text)
    return (None, [call]) if call is not None else (text, [])


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def hermes_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls written as `<tool_call>{json}</tool_call>` (the last may miss its closing tag);
    the text around them is the content (None when there is none)."""
    if "<tool_call>" not in text:
        return text, []
    calls = [c for m in HERMES_CALL.finditer(text) if (c := tool_call(m.group(1))) is not None]
    if not calls:
        return text, []
    content = HERMES_CALL.sub("", text).strip()
    return content or None, calls


def tool_call(text: str) -> dict[str, Any] | None:
    """OpenAI's `tool_calls` entry for a complete constrained output (None if it is not one,
    e.g. cut by max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": json.dumps(call["arguments"], separators=(",", ":")),
        },
    }


CALL_TAG = "<tool_call>"


def streams_content(parser: ReplyParser | None) -> bool:
    """Whether a streamed reply read by `parser` can send its content as it comes (the
    Hermes format: the content is the text around the calls); a forced call goes whole."""
    return parser is hermes_calls


class CallStream:
    """One streamed reply in the Hermes format: `feed` gives the text that can go out now,
    the content before the first `<tool_call>`, holding back a tail that may begin one;
    `finish` reads what was held back into (the rest of the content, the calls)."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        self._held += text
        if self._in_call:
            return ""
        start = self._held.find(CALL_TAG)
        if start >= 0:
            self._in_call = True
        else:  # the longest tail that could be the start of the tag stays
            start = len(self._held) - _tag_prefix_len(self._held)
        out, self._held = self._held[:start], self._held[start:]
        return out

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        held, self._held = self._held, ""
        if not self._in_call:
            return held or None, []
        return hermes_calls(held)


def _tag_prefix_len(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `CALL_TAG`."""
    for n in range(min(len(text), len(CALL_TAG) - 1), 0, -1):
        if CALL_TAG.startswith(text[-n:]):
            return n
    return 0
