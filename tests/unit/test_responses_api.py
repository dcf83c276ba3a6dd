"""OpenAI's Responses API as a chat completion (`router/responses_protocol.py`,
`router/responses_api.py`): the request's chat form, refusals, the Response object, and the
streamed events made of chat chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.router.errors import APIError
from tandem.router.responses_api import _EventWriter, _Head
from tandem.router.responses_protocol import ResponsesRequest
from tandem.router.responses_store import ResponsesStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_a_request_becomes_its_chat_completion() -> None:
    body = ResponsesRequest.model_validate({
        "model": "tiny",
        "instructions": "be brief",
        "input": [
            {"role": "developer", "content": "use tools"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "in Oslo?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        ],
        "max_output_tokens": 20,
        "temperature": 0.5,
        "top_logprobs": 2,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "stream": True,
        "seed": 7,
        "top_k": 4,
        "stream_options": {"include_obfuscation": False},
    })  # fmt: skip
    chat = body.chat_request()
    assert [m.role for m in chat.messages] == ["system", "developer", "user", "assistant",
                                               "tool", "assistant"]  # fmt: skip
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages[0]["content"] == "be brief" and messages[2]["content"] == "weather \nin Oslo?"
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[4] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert messages[5]["content"] == "It is sunny."
    assert (chat.max_completion_tokens, chat.temperature, chat.seed, chat.top_k) == (20, 0.5, 7, 4)
    assert chat.logprobs is True and chat.top_logprobs == 2
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema",
                                    "json_schema": {"name": "w", "schema": {"type": "object"}}}  # fmt: skip
    assert chat.stream and chat.stream_options is not None and chat.stream_options.include_usage
    plain = ResponsesRequest.model_validate({"model": "tiny", "input": "hi"}).chat_request()
    assert [m.model_dump(exclude_none=True) for m in plain.messages] == [
        {"role": "user", "content": "hi"}
    ]
    assert plain.stream_options is None and plain.response_format is None
    assert not plain.logprobs  # (none asked)
    # OpenAI's switch for the output's logprobs: `include` (top_logprobs: the alternatives)
    asked = {"model": "tiny", "input": "hi", "include": ["message.output_text.logprobs"]}
    included = ResponsesRequest.model_validate(asked).chat_request()
    assert (included.logprobs, included.top_logprobs) == (True, 0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"type": "computer_call"}]}, "input"),
        ({"input": []}, "input"),
        ({"temperature": 5}, "temperature"),
        ({"input": [{"role": "user"}]}, "input"),  # (a message without content)
        ({"text": {"format": "bad"}}, "text.format"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ],
)  # fmt: skip
def test_what_cannot_be_a_chat_completion_is_a_400(fields: dict[str, Any], param: str) -> None:
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", **fields})
    with pytest.raises(APIError) as err:
        body.chat_request()
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("tools", [None, []])
def test_openai_s_default_tool_choice_without_tools_is_served(tools: Any) -> None:
    """`tool_choice: "auto"` (or "none") with no tools, as OpenAI's SDK and vLLM's defaults
    send it, is a plain reply; "required" without tools is a 400."""
    for choice in ("auto", "none"):
        body = ResponsesRequest.model_validate(
            {"model": "tiny", "input": "hi", "tools": tools, "tool_choice": choice}
        )
        body.chat_request().check_supported()
    required = ResponsesRequest.model_validate(
        {"model": "tiny", "input": "hi", "tools": tools, "tool_choice": "required"}
    )
    with pytest.raises(APIError) as err:
        required.chat_request().check_supported()
    assert (err.value.status, err.value.param) == (400, "tool_choice")


def _head(**fields: Any) -> _Head:
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", **fields})
    return _Head(body, "tiny", stored=False)


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_a_chat_completion_becomes_a_response() -> None:
    logprobs = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    chat = {
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "Hi", "reasoning_content": "think",
                        "tool_calls": [{"id": "call_9", "type": "function",
                                        "function": {"name": "get_weather", "arguments": "{}"}}]},
            "logprobs": {"content": logprobs},
            "finish_reason": "tool_calls",
        }],
        "usage": {**USAGE, "prompt_tokens_details": {"cached_tokens": 4}},
    }  # fmt: skip
    response = _head(max_output_tokens=9, metadata={"k": "v"}).from_chat(chat)
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert [item["type"] for item in response["output"]] == ["reasoning", "message",
                                                             "function_call"]  # fmt: skip
    reasoning, message, call = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert message["content"] == [{"type": "output_text", "text": "Hi", "annotations": [],
                                   "logprobs": logprobs}]  # fmt: skip
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_9", "get_weather", "{}")
    assert response["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8,
    }  # fmt: skip
    assert (response["max_output_tokens"], response["metadata"]) == (9, {"k": "v"})
    cut = {"choices": [{"message": {"content": "Hi"}, "finish_reason": "length"}], "usage": USAGE}
    response = _head().from_chat(cut)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][-1]["status"] == "incomplete"  # (the item the limit cut)
    only_call = {"choices": [{"message": {"content": None, "tool_calls": chat["choices"][0][
        "message"]["tool_calls"]}, "finish_reason": "tool_calls"}], "usage": USAGE}  # fmt: skip
    assert [i["type"] for i in _head().from_chat(only_call)["output"]] == ["function_call"]
    # thoughts alone: no empty message after them, as streamed
    thoughts = {"choices": [{"message": {"content": None, "reasoning_content": "hm"},
                             "finish_reason": "length"}], "usage": USAGE}  # fmt: skip
    assert [i["type"] for i in _head().from_chat(thoughts)["output"]] == ["reasoning"]
    assert _head().from_chat(thoughts)["completed_at"] is None  # (incomplete)
    done = _head(top_logprobs=3).from_chat(only_call)
    assert done["top_logprobs"] == 3 and isinstance(done["completed_at"], int)


def _stream(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    writer = _EventWriter(_head())
    events = [e for chunk in chunks for e in writer.on_chunk(chunk)] + writer.finish()
    parsed = []
    for event in events:
        kind_line, data_line = event.strip().split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {data['type']}"
        parsed.append(data)
    return parsed


def _delta(finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_chat_chunks_become_the_responses_events_in_order() -> None:
    events = _stream([
        _delta(role="assistant"),
        _delta(reasoning_content="hm"),
        _delta(content="Hel"),
        _delta(content="lo", finish="length"),
        {"choices": [], "usage": USAGE},
    ])  # fmt: skip
    assert [e["type"] for e in events] == [
        # (the reasoning item announces its text part too, as OpenAI's PartReasoningText)
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "Hel", "lo"
    ]  # fmt: skip
    final = events[-1]["response"]
    assert final["completed_at"] is None and final["top_logprobs"] is None
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["usage"]["output_tokens"] == 3 and final["status"] == "incomplete"
    assert [i["status"] for i in final["output"]] == ["completed", "incomplete"]
    assert events[-2]["item"]["status"] == "incomplete"  # (its output_item.done)
    assert events[6]["output_index"] == 1 and events[6]["item"]["status"] == "in_progress"
    assert events[1]["part"] == {"type": "reasoning_text", "text": ""}


def test_streamed_tool_calls_and_errors() -> None:
    call0 = {"index": 0, "id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    events = _stream([
        _delta(content="Let me check. "),
        _delta(tool_calls=[call0]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city":'}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
        _delta(tool_calls=[{"index": 1, "id": "call_b", "function": {"name": "noop", "arguments": "{}"}}],
               finish="tool_calls"),
        {"choices": [], "usage": USAGE},
    ])  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == 3
    assert kinds[-1] == "response.completed"
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"city":"Oslo"}', "{}"]
    output = events[-1]["response"]["output"]
    assert [(i["type"], i.get("call_id")) for i in output] == [
        ("message", None), ("function_call", "call_a"), ("function_call", "call_b")
    ]  # fmt: skip
    assert all(i["status"] == "completed" for i in output)

    failed = _stream([_delta(content="x"), {"error": {"message": "decode worker died",
                                                      "code": "decode_failed"}}])  # fmt: skip
    assert [e["type"] for e in failed][-2:] == ["error", "response.failed"]
    assert failed[-2]["code"] == "decode_failed"
    assert failed[-1]["response"]["status"] == "failed"
    assert failed[-1]["response"]["error"]["code"] == "server_error"  # (one of OpenAI's codes)
    empty = _stream([_delta(finish="stop"), {"choices": [], "usage": USAGE}])
    assert empty[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert "response.output_text.delta" not in [e["type"] for e in empty]


def test_a_stored_conversation_goes_before_the_new_input() -> None:
    """`previous_response_id`: the stored input and output items, then the new input; the
    earlier instructions do not carry over (the new ones lead)."""
    store = ResponsesStore(capacity=2)
    first = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", "instructions": "a"})
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f",
            "arguments": "{}", "status": "completed"}  # fmt: skip
    reply = {"id": "resp_1", "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
        call,
    ]}  # fmt: skip
    store.put(reply, first.input_items())
    follow = ResponsesRequest.model_validate({
        "model": "tiny", "previous_response_id": "resp_1", "instructions": "b",
        "input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}],
    })  # fmt: skip
    chat = follow.chat_request(store.get("resp_1").conversation())
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "b"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]  # fmt: skip
    # Bounded: the oldest goes first; unknown and deleted ids are a 404 naming the field.
    store.put({"id": "resp_2", "output": []}, [])
    store.put({"id": "resp_3", "output": []}, [])
    assert len(store) == 2
    for gone in ("resp_1", "nope"):
        with pytest.raises(APIError) as err:
            store.get(gone, "previous_response_id")
        assert (err.value.status, err.value.param) == (404, "previous_response_id")
    assert store.delete("resp_2") == {"id": "resp_2", "object": "response", "deleted": True}
    with pytest.raises(APIError):
        store.delete("resp_2")
    ResponsesStore(capacity=0).put({"id": "resp_9", "output": []}, [])  # keeps nothing


def test_a_stored_responses_input_items_are_listed_as_openai_lists_them() -> None:
    """`client.responses.input_items.list(id)` (GET /v1/responses/{id}/input_items) was a 404."""
    from tandem.router.errors import APIError
    from tandem.router.responses_store import ResponsesStore

    store = ResponsesStore()
    inputs = [{"type": "message", "role": "user", "content": "a"},
              {"type": "message", "role": "user", "content": "b", "id": "msg_b"},
              {"type": "message", "role": "user", "content": "c"}]  # fmt: skip
    store.put({"id": "resp_1", "output": []}, inputs)
    newest = store.input_items("resp_1")
    assert [i["id"] for i in newest["data"]] == ["resp_1_input_2", "msg_b", "resp_1_input_0"]
    assert (newest["object"], newest["has_more"], newest["first_id"]) == (
        "list", False, "resp_1_input_2",
    )  # fmt: skip
    page = store.input_items("resp_1", order="asc", limit=1, after="resp_1_input_0")
    assert [i["content"] for i in page["data"]] == [[{"type": "input_text", "text": "b"}]]
    assert page["has_more"] and page["data"][0]["status"] == "completed"  # (OpenAI's shape)
    with pytest.raises(APIError) as missing:
        store.input_items("resp_2")
    assert missing.value.status == 404
