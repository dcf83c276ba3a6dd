"""Function calling (`router/tool_calls.py`): which tools a tool_choice forces, the schema of
one call, the `tool_calls` entry a complete call becomes, and calls read from a free reply in
the Hermes format (`tool_choice` "auto")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.router.errors import APIError
from tandem.router.tool_calls import (
    FunctionSpec,
    NamedCall,
    ToolSpec,
    call_schema,
    finishes_with_calls,
    forced_call,
    forced_tools,
    reply_parser,
    streams_content,
    tool_call,
)
from tandem.router.tool_parsers import HermesParser, MistralParser

TOOLS = [
    ToolSpec.model_validate(
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}
    ),
    ToolSpec.model_validate({"type": "function", "function": {"name": "b"}}),
]


def test_which_tools_a_choice_forces() -> None:
    assert forced_tools(None, None) is None and forced_tools(TOOLS, "none") is None
    assert forced_tools(TOOLS, None) is None and forced_tools(TOOLS, "auto") is None
    assert forced_tools(TOOLS, "required") == TOOLS
    named = {"type": "function", "function": {"name": "b"}}
    assert forced_tools(TOOLS, named) == TOOLS[1:]
    assert isinstance(reply_parser(TOOLS, None), HermesParser)
    one = reply_parser(TOOLS, "auto", parallel=False)  # (OpenAI's parallel_tool_calls=false)
    assert isinstance(one, HermesParser) and one.max_calls == 1
    assert reply_parser(TOOLS, "auto").max_calls is None  # type: ignore[union-attr]
    assert isinstance(reply_parser(TOOLS, "auto"), HermesParser)
    mistral = MistralParser()
    assert reply_parser(TOOLS, "auto", mistral) is mistral
    assert reply_parser(TOOLS, "required") is forced_call and reply_parser(TOOLS, "none") is None
    named_parser = reply_parser(TOOLS, named)  # the same reading, finish reason "stop"
    assert isinstance(named_parser, NamedCall) and named_parser.name == "b"
    assert not finishes_with_calls(named_parser, "stop")
    assert finishes_with_calls(forced_call, "stop")
    assert reply_parser(None, None) is None
    for tools, choice, param in (
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
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    assert both["anyOf"][1]["properties"]["arguments"] == no_arguments  # no parameters


def test_a_complete_call_becomes_a_tool_calls_entry() -> None:
    call = tool_call('{"name":"a","arguments":{"x":1}}')
    assert call is not None and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "a" and json.loads(call["function"]["arguments"]) == {"x": 1}
    assert tool_call('{"name":"a","argu') is None  # cut short
    assert tool_call('{"x": 1}') is None


hermes_calls = HermesParser()


def test_calls_read_from_a_free_reply_in_the_hermes_format() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}'  # the last one unclosed (the model stopped)
    )
    content, calls = hermes_calls(text)
    assert content == "Let me check.\n"  # (as vLLM keeps it, and as it streams)
    assert hermes_calls("\n\n" + text[14:])[0] is None  # (whitespace alone is no content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"city": "Oslo"}),
        ("b", {}),
    ]
    assert hermes_calls("no calls here") == ("no calls here", [])
    assert hermes_calls("<tool_call>{not json</tool_call>") == (
        "<tool_call>{not json</tool_call>",
        [],
    )
    only, calls = hermes_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert only is None and len(calls) == 1


def test_only_the_hermes_format_streams_its_content() -> None:
    assert streams_content(reply_parser(TOOLS, "auto"))
    assert not streams_content(reply_parser(TOOLS, "required"))
    assert not streams_content(None)


def test_a_conversation_goes_back_to_the_template_with_calls_and_thoughts() -> None:
    from tandem.router.openai_protocol import ChatMessage, template_messages

    call = {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": "{}"}}
    as_object = {**call, "function": {"name": "a", "arguments": {}}}
    messages = [
        ChatMessage.model_validate({"role": "developer", "content": "be brief"}),
        ChatMessage.model_validate({"role": "user", "content": "go", "ignored": 1}),
        ChatMessage.model_validate(
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hm"}
        ),
        ChatMessage.model_validate(
            {"role": "tool", "content": "done", "tool_call_id": "call_1", "name": "a"}
        ),
    ]
    assert template_messages(messages) == [
        {"role": "system", "content": "be brief"},  # (OpenAI's developer role)
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [as_object], "reasoning": "hm",
         "reasoning_content": "hm"},  # (both names, as vLLM's)
        {"role": "tool", "content": "done", "tool_call_id": "call_1", "name": "a"},
    ]  # fmt: skip
    # vLLM's newer name for the thoughts, `reasoning`, is read too
    newer = {"role": "assistant", "content": "ok", "reasoning": "think"}
    assert template_messages([ChatMessage.model_validate(newer)]) == [
        {"role": "assistant", "content": "ok", "reasoning": "think", "reasoning_content": "think"}
    ]
    # (a whole reply sent back as it came, with its empty list, is a message without calls:
    # templates that test `'tool_calls' in message` would take it for a call)
    reply = {"role": "assistant", "content": "hi", "tool_calls": [], "refusal": None}
    assert template_messages([ChatMessage.model_validate(reply)]) == [
        {"role": "assistant", "content": "hi"}
    ]


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    """OpenAI's JSON text becomes the object it encodes (templates write `arguments | tojson`;
    text would render as a quoted string); empty is {}; text that is no JSON stays."""
    from tandem.engine.chat_content import template_tool_calls

    def call(arguments: Any) -> dict[str, Any]:
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}

    given = [call('{"city": "Paris", "n": [1]}'), call(""), call("{not json"), call({"a": 1})]
    got = [c["function"]["arguments"] for c in template_tool_calls(given)]
    assert got == [{"city": "Paris", "n": [1]}, {}, "{not json", {"a": 1}]
    assert given[0]["function"]["arguments"] == '{"city": "Paris", "n": [1]}'  # (a copy)
    assert template_tool_calls("odd") == "odd"


def test_a_forced_call_cut_short_is_still_the_call() -> None:
    """As vLLM returns a cut call: the call, with the arguments written so far."""
    named_call = NamedCall("get_weather")
    content, calls = named_call('{"name": "get_weather", "arguments": {"city": "Par')
    assert content is None and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    complete = NamedCall("a")('{"name": "a", "arguments": {"x": 1, "city": "Zürich"}}')[1]
    # (a whole call's arguments as vLLM writes them: json.dumps, non-ASCII kept)
    assert complete[0]["function"] == {"name": "a", "arguments": '{"x": 1, "city": "Zürich"}'}
    for text in ('{"name": "get_wea', '{"name": "get_weather"', ""):  # (the name is known)
        content, calls = named_call(text)
        assert content is None
        assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    content, calls = forced_call('{"name": "a", "arguments": {"x"')  # "required"
    assert content is None and calls[0]["function"] == {"name": "a", "arguments": '{"x"'}
    assert forced_call('{"name": "a"')[1][0]["function"] == {"name": "a", "arguments": ""}
    assert forced_call('{"name": "a') == (None, [])  # which function is not known yet


def test_a_required_call_cut_short_finishes_with_length() -> None:
    """As vLLM's: "tool_calls" ends a "required" call only when it stopped; cut by max_tokens
    it stays "length" (an "auto" reply that made calls always ends with "tool_calls")."""
    assert finishes_with_calls(forced_call, "stop")
    assert not finishes_with_calls(forced_call, "length")
    assert finishes_with_calls(HermesParser(), "length")
    assert not finishes_with_calls(NamedCall("a"), "length")


def test_a_cut_required_call_s_body_and_stream_finish_with_length() -> None:
    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.openai_format import ResponseHead, full_body
    from tandem.router.openai_stream import from_reply
    from tandem.router.prepared import Prepared
    from tandem.router.request_timings import RequestTimings

    head = ResponseHead("chatcmpl-1", 0, "m", "chat", read_calls=forced_call)
    req = Prepared("r", [1, 2], SamplingParams(max_tokens=4), RequestTimings(0.0))
    req.text, req.finish_reason = '{"name": "a", "arguments": {"x"', "length"
    choice = full_body(head, [req], {})["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "a", "arguments": '{"x"'}
    events = [json.loads(e[len("data: ") :]) for e in from_reply(head, req, 0, "length")]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "length"]
    req.text, req.finish_reason = '{"name": "a", "arguments": {"x": 1}}', "stop"
    assert full_body(head, [req], {})["choices"][0]["finish_reason"] == "tool_calls"
    events = [json.loads(e[len("data: ") :]) for e in from_reply(head, req, 0, "stop")]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "tool_calls"]


def test_a_streamed_forced_call_carries_its_logprobs_and_usage() -> None:
    """Streamed, a forced call (one chunk at its end) gave no logprobs and no running usage,
    where the same request not streamed gave every token's."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.openai_format import ResponseHead
    from tandem.router.openai_stream import from_reply
    from tandem.router.prepared import Prepared
    from tandem.router.request_timings import RequestTimings

    head = ResponseHead("chatcmpl-1", 0, "m", "chat", token_text=chr, read_calls=forced_call)
    req = Prepared("r", [1, 2], SamplingParams(max_tokens=9, logprobs=1), RequestTimings(0.0))
    req.text, req.finish_reason = '{"name": "a", "arguments": {}}', "stop"
    req.token_ids = [65, 66, 67]
    req.logprobs = [(-0.5, [(65, -0.5)]), (-0.25, [(66, -0.25)]), (-1.0, [(68, -0.75)])]
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    events = [json.loads(e[len("data: ") :]) for e in from_reply(head, req, 0, "stop", usage)]
    content = events[0]["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("A", -0.5), ("B", -0.25), ("C", -1.0)]
    assert content[2]["top_logprobs"] == [{"token": "D", "logprob": -0.75, "bytes": [68]}]
    assert [e["usage"] for e in events] == [usage, usage]
    assert events[1]["choices"][0]["logprobs"] is None


def test_a_function_without_parameters_takes_no_arguments() -> None:
    bare = ToolSpec(function=FunctionSpec(name="ping"))
    schema = call_schema([bare])
    assert schema["properties"]["arguments"] == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "a"}}]
)
def test_a_tool_choice_without_tools_is_a_400(choice: Any) -> None:
    """As vLLM's: any tool_choice but "none" needs `tools` (an empty list passes, as there)."""
    from tandem.router.openai_protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}
    with pytest.raises(APIError) as refused:
        ChatCompletionRequest.model_validate(body).check_supported()
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    ChatCompletionRequest.model_validate({**body, "tool_choice": "none"}).check_supported()
    ChatCompletionRequest.model_validate(
        {**body, "tool_choice": "auto", "tools": []}
    ).check_supported()


def test_a_whole_chat_reply_has_every_field_of_vllm_s() -> None:
    """vLLM's server writes every field of a chat reply's message, null or empty (code that
    reads `message["tool_calls"]` finds a list), and null `service_tier` / `system_fingerprint`
    / `prompt_logprobs`."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.openai_format import ResponseHead, full_body
    from tandem.router.prepared import Prepared
    from tandem.router.request_timings import RequestTimings

    head = ResponseHead("chatcmpl-1", 0, "m", "chat")
    req = Prepared("r", [1, 2], SamplingParams(max_tokens=4), RequestTimings(0.0))
    req.text, req.finish_reason = "hello", "stop"
    body = full_body(head, [req], {})
    assert body["choices"][0]["message"] == {
        "role": "assistant", "content": "hello", "refusal": None, "annotations": None,
        "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None,
    }  # fmt: skip
    assert list(body["choices"][0]["message"])[:2] == ["role", "content"]
    nulls = ("service_tier", "system_fingerprint", "prompt_logprobs")
    assert [body[k] for k in nulls] == [None, None, None]
    called = ResponseHead("chatcmpl-2", 0, "m", "chat", read_calls=forced_call)
    req.text = '{"name": "a", "arguments": {"x": 1}}'
    message = full_body(called, [req], {})["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "a"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "arr"}}])
def test_a_forced_function_needs_object_parameters(choice: Any) -> None:
    """Its call's arguments were cut wrong (`[1,2]}`, not JSON) when its schema was an array;
    OpenAI's schemas are objects: a 400 that says so."""
    tools = [
        ToolSpec.model_validate(
            {"type": "function", "function": {"name": "arr", "parameters": {"type": "array"}}}
        )
    ]
    with pytest.raises(APIError) as info:
        forced_tools(tools, choice)
    assert info.value.status == 400 and "of type 'object'" in info.value.message
    assert forced_tools(tools, "auto") is None  # (read from a free reply: left to the parser)


def test_one_call_read_whole_though_a_later_one_is_broken() -> None:
    """parallel_tool_calls=false reads the first call: a broken second one lost it too (the
    whole reply came back as content, finish "stop"), where the stream sent the first."""
    first = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "b", "arguments": {"y": \n</tool_call>'
    one = reply_parser(TOOLS, "auto", parallel=False)
    assert one is not None
    content, calls = one(f"{first}\n{broken}")
    assert content is None and [c["function"]["name"] for c in calls] == ["a"]
    every = reply_parser(TOOLS, "auto")
    assert every is not None and every(f"{first}\n{broken}")[1] == []  # (all: none parse)
    # a broken first call: nothing read, the whole reply is the content (not cut at the second)
    assert one(f"{broken}\n{first}") == (f"{broken}\n{first}", [])
