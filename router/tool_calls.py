"""Function calling: the tools go to the chat template, and the reply's calls come back as
OpenAI's `tool_calls` (finish reason "tool_calls").

- `tool_choice` "required" or a named function: the output is constrained (structured output,
  `engine/guided.py`) to one JSON object `{"name": <a tool's name>, "arguments": <that tool's
  parameters>}`. A named function's reply ends with finish reason "stop" (as OpenAI's and
  vLLM's), the others' calls with "tool_calls" (a "required" call cut by max_tokens: "length").
- "auto" (OpenAI's default with tools): the model decides. Its calls are read in its family's
  format (`tool_parsers.py`: Hermes' `<tool_call>{...}</tool_call>`, Llama 3's JSON, Mistral's
  `[TOOL_CALLS]`); the text outside them is the message's content, and a reply whose calls do
  not parse is all content. Streamed, the content goes out as it comes until a call may begin,
  then each call as it is written: its name, then its arguments piece by piece
  (`call_stream.CallStream`).
- "none", or no tools: plain chat.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.router.errors import bad_request
from tandem.router.tool_parsers import HermesParser, ToolParser, call_entry, call_record


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
    if tool_choice is not None and tools is None:  # (as vLLM's: an empty list passes)
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice in (None, "auto"):
        return None
    if not tools:
        raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "required":
        chosen = tools
    else:
        name = _named(tool_choice)
        chosen = [t for t in tools if t.function.name == name][:1]
        if not chosen:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    for tool in chosen:  # (a call's arguments are an object, as OpenAI's schemas must say)
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise bad_request(
                f"function {tool.function.name!r}: parameters must be a JSON schema of type "
                f"'object' to be forced by tool_choice, got {kind!r}",
                "tools",
            )
    return chosen


def _named(tool_choice: Any) -> str:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return name
    raise bad_request(
        f"tool_choice {tool_choice!r} is not one of auto, none, required, or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function given without `parameters` (OpenAI: it takes none)."""


def call_schema(tools: list[ToolSpec]) -> dict[str, Any]:
    """The JSON schema of one call of one of `tools`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or NO_ARGUMENTS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def template_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (transformers' `tools=`)."""
    return [t.model_dump() for t in tools]  # (nulls too: vLLM passes model_dump() as it is)


ReplyParser = Callable[[str], tuple[str | None, list[dict[str, Any]]]]
"""A reply's text -> (its content, its `tool_calls`): a `ToolParser`, or `forced_call`."""


def reply_parser(
    tools: list[ToolSpec] | None,
    tool_choice: Any,
    parser: ToolParser | None = None,
    parallel: bool = True,
) -> ReplyParser | None:
    """How to read the reply's calls (None: plain text); "auto" reads them with `parser`
    (Hermes' format when not given), only the first without `parallel` (a forced call is one
    call either way)."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        chosen = parser or HermesParser()
        return chosen if parallel else chosen.at_most(1)
    return forced_call if tool_choice == "required" else NamedCall(_named(tool_choice))


def forced_call(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A constrained reply: one call. Cut short by max_tokens once its name is written, the call
    still comes back, with the arguments written so far (incomplete JSON, "" before they
    begin), as vLLM returns a cut call; cut before, the reply has neither content nor calls
    (the constrained text is no prose)."""
    return _read_call(text)


def _read_call(text: str, name: str | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    call = tool_call(text)
    if call is None:
        call = _cut_call(text, name)
    return None, [] if call is None else [call]


_CUT_CALL = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(?:,\s*"arguments"\s*:\s*(.*))?\Z', re.S
)
"""A constrained call cut short after its name: the name, and the arguments so far if begun."""


def _cut_call(text: str, name: str | None = None) -> dict[str, Any] | None:
    """The `tool_calls` entry of a constrained call cut short: its name (as written, else
    `name`) and its arguments so far; None when no name is known."""
    cut = _CUT_CALL.match(text)
    if cut is not None:
        name, arguments = json.loads(cut.group(1)), cut.group(2) or ""
    elif name is not None:
        arguments = ""
    else:
        return None
    return call_record(name, arguments)


class NamedCall:
    """`forced_call` for a `tool_choice` that names the function: OpenAI's (and vLLM's)
    finish reason is then "stop", not "tool_calls" (`finishes_with_calls`), and a call cut
    short before its name was written still comes back, under that name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return _read_call(text, self.name)


def finishes_with_calls(parser: ReplyParser | None, finish: str | None) -> bool:
    """Whether a reply read by `parser` that made calls, and finished with `finish`, ends with
    finish reason "tool_calls" instead: not a named function's; a "required" call only when it
    stopped (cut by max_tokens it stays "length", as vLLM's); a free reply's ("auto") always."""
    if isinstance(parser, NamedCall):
        return False
    return parser is not forced_call or finish == "stop"


def tool_call(text: str) -> dict[str, Any] | None:
    """OpenAI's `tool_calls` entry for a complete constrained output (None if it is not one,
    e.g. cut by max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        return None
    return call_entry(call["name"], call["arguments"])


def streams_content(parser: ReplyParser | None) -> bool:
    """Whether a streamed reply read by `parser` can send its content as it comes (a free
    reply); a forced call goes whole."""
    return isinstance(parser, ToolParser)
