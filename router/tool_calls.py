"""Function calling when the caller forces it: `tool_choice` "required" or a named function.

The output is constrained (structured output, `engine/guided.py`) to one JSON object
`{"name": <a tool's name>, "arguments": <that tool's parameters>}`, and answered as OpenAI's
`tool_calls` (finish reason "tool_calls"). The tools also go to the chat template, so the model
sees them as its template presents them. `tool_choice` "auto" (the model decides whether to
call, in its own format) needs a parser per model family and is refused; "none", or no tools,
is plain chat.
"""

from __future__ import annotations

import json
import uuid
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
    if tool_choice is None:
        if tools:
            raise _auto()
        return None
    if not tools:
        raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto":
        raise _auto()
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


def _auto() -> Exception:
    return bad_request(
        "tool_choice 'auto' (the default with tools) is not supported: send 'required', a "
        "named function, or 'none'",
        "tool_choice",
        "unsupported",
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
