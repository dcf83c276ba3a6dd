"""Forced function calling (`router/tool_calls.py`): which tools a tool_choice forces, the
schema of one call, and the `tool_calls` entry a complete call becomes."""

from __future__ import annotations

import json

import pytest

from tandem.router.errors import APIError
from tandem.router.tool_calls import ToolSpec, call_schema, forced_tools, tool_call

TOOLS = [
    ToolSpec.model_validate(
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}
    ),
    ToolSpec.model_validate({"type": "function", "function": {"name": "b"}}),
]


def test_which_tools_a_choice_forces() -> None:
    assert forced_tools(None, None) is None and forced_tools(TOOLS, "none") is None
    assert forced_tools(TOOLS, "required") == TOOLS
    named = {"type": "function", "function": {"name": "b"}}
    assert forced_tools(TOOLS, named) == TOOLS[1:]
    for tools, choice, param in (
        (TOOLS, None, "tool_choice"),  # OpenAI's default with tools is "auto"
        (TOOLS, "auto", "tool_choice"),
        (None, "required", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "zz"}}, "tool_choice"),
        (TOOLS, {"type": "code"}, "tool_choice"),
    ):
        with pytest.raises(APIError) as info:
            forced_tools(tools, choice)
        assert info.value.status == 400 and info.value.param == param


def test_the_schema_of_a_call() -> None:
    one = call_schema(TOOLS[:1])
    assert one["properties"]["name"] == {"const": "a"} and one["required"] == ["name", "arguments"]
    both = call_schema(TOOLS)
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["a", "b"]
    assert both["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters


def test_a_complete_call_becomes_a_tool_calls_entry() -> None:
    call = tool_call('{"name":"a","arguments":{"x":1}}')
    assert call is not None and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "a" and json.loads(call["function"]["arguments"]) == {"x": 1}
    assert tool_call('{"name":"a","argu') is None  # cut short
    assert tool_call('{"x": 1}') is None
