"""Structured output and function calling, end to end through the real `openai` client on
1 prefill + 1 decode and 2 + 2: `response_format`, vLLM's structured-output fields, forced and
free ("auto") tool calls, streamed and not, each as the colocated engine gives it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.openai_shared import PROMPTS, TOOLS, client

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_structured_output_through_the_cluster(base_url: str, reference: LLM) -> None:
    """`response_format`: JSON mode and a JSON schema, as the in-process engine gives them."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    c = client(base_url)
    messages = [{"role": "user", "content": "answer in JSON"}]
    rendered = reference.engine.tokenizer.apply_chat_template(messages)
    for fmt, want_schema in (
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}, schema),
        ({"type": "json_object"}, {"type": "object"}),
    ):
        params = SamplingParams(temperature=0, max_tokens=48, json_schema=want_schema)
        want = reference.generate([rendered], params, use_tqdm=False)[0]
        out = c.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=48,
            temperature=0,
            response_format=fmt,  # type: ignore[arg-type]
        )
        assert out.choices[0].message.content == want.text
        assert out.choices[0].finish_reason == want.finish_reason
        if want.finish_reason == "stop":
            assert isinstance(json.loads(want.text), dict)
    out = c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},  # type: ignore[arg-type]
    )
    assert json.loads(out.choices[0].message.content or "")["answer"] in ("yes", "no")


def test_vllm_structured_output_fields_through_the_cluster(base_url: str, reference: LLM) -> None:
    """vLLM's `guided_choice`, `guided_regex` and `structured_outputs` (regex, grammar), as
    the in-process engine gives them; streamed too."""
    c = client(base_url)
    prompt = PROMPTS[1]
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"guided_choice": ["red", "green", "blue sky"]}, {"choice": ["red", "green", "blue sky"]}),
        ({"guided_regex": "[0-9]{3}-[a-c]{2}"}, {"regex": "[0-9]{3}-[a-c]{2}"}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        (
            {"structured_outputs": {"grammar": 'root ::= "(" [0-9] ("," [0-9])? ")"'}},
            {"grammar": 'root ::= "(" [0-9] ("," [0-9])? ")"'},
        ),
    ]
    for body, engine_fields in cases:
        params = SamplingParams(temperature=0, max_tokens=24, **engine_fields)
        want = reference.generate([prompt], params, use_tqdm=False)[0]
        assert want.finish_reason == "stop"
        out = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body=body
        )
        assert (out.choices[0].text, out.choices[0].finish_reason) == (want.text, "stop")
        stream = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body=body, stream=True
        )
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want.text
    assert want.text.startswith("(")  # (the last case: the grammar's shape)


def test_forced_tool_calls(base_url: str) -> None:
    """tool_choice naming a function, or "required": the reply is a `tool_calls` entry whose
    arguments follow the function's parameters; streamed, it comes whole in one delta (the
    "auto" reply's content streams: see the last test)."""
    c = client(base_url)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = c.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=64,  # type: ignore[arg-type]
    )
    choice = out.choices[0]
    # (a named function ends with "stop", as OpenAI's and vLLM's; "required" with "tool_calls")
    assert choice.finish_reason == "stop" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo")  # type: ignore[union-attr]
    stream = c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=64,
        stream=True,
    )
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    calls_streamed = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]
    assert len(calls_streamed) == 1 and deltas[-1].finish_reason == "tool_calls", deltas[-3:]
    # (the finish reason alone after the call, as OpenAI sends it: the `openai` stream helper
    # ends a call only so)
    assert [d.finish_reason for d in deltas if d.delta.tool_calls] == [None]
    call = calls_streamed[0][0]
    assert call.function is not None and call.function.name in ("get_weather", "noop")
    assert isinstance(json.loads(call.function.arguments or ""), dict)
    # Cut short by max_tokens, the call still comes back, with its arguments so far ("" when
    # they had not begun).
    assert out.usage is not None
    for max_tokens in (out.usage.completion_tokens - 2, 1):
        cut = c.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=named,  # type: ignore[arg-type]
            max_tokens=max_tokens,
        ).choices[0]
        assert cut.message.content is None and cut.message.tool_calls is not None
        function = cut.message.tool_calls[0].function  # type: ignore[union-attr]
        assert function.name == "get_weather"
        if max_tokens == 1:
            assert function.arguments == "" and cut.finish_reason == "length"
        else:  # (the JSON so far; the tiny model's two cities are a near-tie)
            so_far = function.arguments.replace(" ", "")
            wholes = ('{"city":"Paris"}', '{"city":"Oslo"}')
            assert so_far and any(w.startswith(so_far) for w in wholes), so_far
            # The shorter city may end the call within the cut ("stop"), or its JSON may be
            # whole while its end is still to come ("length"); a call cut short is "length".
            allowed = ("stop", "length") if so_far in wholes else ("length",)
            assert cut.finish_reason in allowed, so_far
    # A conversation that goes on after the call: the tool's answer goes to the template.
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    ]
    again = c.chat.completions.create(model="tiny", messages=follow, max_tokens=4)  # type: ignore[arg-type]
    assert again.choices[0].finish_reason in ("length", "stop")
    # "auto" (the default with tools): the tiny model writes no call, so its text is the content
    # (it may end early: which of its near-tied tokens wins moves with the prefix cache's history)
    auto = c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
    )
    assert auto.choices[0].message.tool_calls == [] and auto.choices[0].message.content
    assert auto.choices[0].finish_reason in ("length", "stop")


def test_auto_tool_calls_stream_the_content_before_the_call(base_url: str) -> None:
    """ "auto": a reply in the Hermes format (written here by a grammar, as a tool-trained
    model would) streams its content as it comes, then its call as it is written: the name,
    then the arguments in pieces that the client joins."""
    c = client(base_url)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    reply = f"Checking. <tool_call>{json.dumps(call)}</tool_call>"
    kwargs: dict[str, Any] = {"model": "tiny", "tools": TOOLS, "temperature": 0}
    kwargs.update(messages=[{"role": "user", "content": "weather in Oslo?"}], max_tokens=160)
    kwargs["extra_body"] = {"structured_outputs": {"grammar": f"root ::= {json.dumps(reply)}"}}
    out = c.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Checking. "
    assert message.tool_calls is not None
    got = [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls]  # type: ignore[union-attr]
    assert got == [("get_weather", {"city": "Oslo"})]
    deltas = [
        ch.choices[0] for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices
    ]
    contents = [d.delta.content for d in deltas if d.delta.content]
    # as it came, and as the whole reply's (vLLM keeps the text before a call unstripped)
    assert "".join(contents) == message.content and len(contents) > 1
    streamed = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
    assert len(streamed) > 2 and deltas[-1].finish_reason == "tool_calls"
    assert [d.finish_reason for d in deltas if d.delta.tool_calls][-1] is None
    assert {t.index for t in streamed} == {0} and streamed[0].id and streamed[0].function
    assert streamed[0].function.name == "get_weather" and all(t.id is None for t in streamed[1:])
    arguments = "".join(t.function.arguments or "" for t in streamed if t.function)
    assert json.loads(arguments) == {"city": "Oslo"}
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    kwargs["extra_body"] = {"structured_outputs": {"grammar": f"root ::= {json.dumps(broken)}"}}
    whole = c.chat.completions.create(**kwargs).choices[0]  # arguments not JSON: content
    assert (whole.finish_reason, whole.message.content) == ("stop", broken)
    assert whole.message.tool_calls == []  # (vLLM's message always has the list)
    deltas = [
        ch.choices[0] for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices
    ]
    # streamed, the call's head went out before its arguments broke: as vLLM's, the stream
    # ends with the call's pieces (its text is not sent again as content)
    assert "".join(d.delta.content or "" for d in deltas) == ""
    streamed = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
    assert streamed[0].function and streamed[0].function.name == "get_weather"
    assert deltas[-1].finish_reason == "tool_calls"
