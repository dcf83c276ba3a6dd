"""OpenAI's Responses API (`POST /v1/responses`) end to end through the real `openai` client on
1 prefill + 1 decode: the same tokens as the chat API's, streamed events the SDK's stream
helper assembles, function calls, a client that leaves mid-stream, and refusals."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.conftest import Cluster
from tests.integration.openai_shared import TOOLS, client, wait_baseline

pytestmark = [pytest.mark.ray, pytest.mark.slow]
DEPLOYMENT = "1x1"  # (conftest groups the tests by deployment)

QUESTION = "tandem serves prefill and decode on separate workers"
WEATHER = {"type": "function", **TOOLS[0]["function"]}
"""The weather lookup as a Responses API function tool (no `function` wrapper)."""


@pytest.fixture(scope="module")
def url(cluster: Cluster) -> str:
    return cluster.deploy_pd(1)


@pytest.fixture(scope="module")
def want(reference: LLM) -> Any:
    """The greedy reply to the instructions and the question, 12 tokens, in process."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTION}]
    rendered = reference.engine.tokenizer.apply_chat_template(messages)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return reference.generate([rendered], params, use_tqdm=False)[0]


def test_a_response_is_the_chat_reply(url: str, want: Any) -> None:
    response = client(url).responses.create(
        model="tiny",
        instructions="be brief",
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == want.text
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        len(want.prompt_token_ids),
        12,
    )
    assert [item.type for item in response.output] == ["message"]


def test_a_stored_response_is_retrieved_continued_and_deleted(
    url: str, want: Any, reference: LLM
) -> None:
    """store (the default): `responses.retrieve` returns the reply; `previous_response_id`
    goes on from its conversation exactly as the chat of the whole conversation would;
    `delete` forgets it; store=false keeps nothing."""
    c = client(url)
    greedy = {"max_output_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = c.responses.create(model="tiny", instructions="be brief", input=QUESTION, **greedy)
    assert first.store and c.responses.retrieve(first.id).output_text == want.text
    follow = c.responses.create(
        model="tiny", previous_response_id=first.id, input="and then?", stream=True, **greedy
    )
    final = [e for e in follow if e.type == "response.incomplete"][0].response
    assert final.previous_response_id == first.id
    conversation = [
        {"role": "user", "content": QUESTION},  # (the first instructions do not carry over)
        {"role": "assistant", "content": want.text},
        {"role": "user", "content": "and then?"},
    ]
    rendered = reference.engine.tokenizer.apply_chat_template(conversation)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert final.output_text == reference.generate([rendered], params, use_tqdm=False)[0].text
    assert c.responses.retrieve(final.id).output_text == final.output_text  # streamed: stored
    listed = c.responses.input_items.list(final.id, order="asc")  # (the conversation before it)
    assert [getattr(i, "role", None) for i in listed.data] == ["user", "assistant", "user"]
    c.responses.delete(first.id)
    for gone in (first.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(gone)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|no response"):
        c.responses.create(model="tiny", previous_response_id=first.id, input="x", **greedy)
    unstored = c.responses.create(model="tiny", input="x", store=False, **greedy)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_a_streamed_response_assembles_to_the_same_reply(url: str, want: Any) -> None:
    c = client(url)
    kwargs: dict[str, Any] = {"model": "tiny", "instructions": "be brief", "input": QUESTION,
                              "max_output_tokens": 12, "temperature": 0,
                              "extra_body": {"ignore_eos": True}}  # fmt: skip
    events = list(c.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want.text
    # The SDK's helper assembles a completed response (one ended by max_output_tokens ends
    # with `response.incomplete`, as OpenAI's does, and the helper gives no final response
    # then): end this one with a stop string instead.
    stop = want.text.strip()[-3:]
    kwargs["extra_body"] = {"ignore_eos": True, "stop": [stop]}
    with c.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == want.text[: want.text.find(stop)]


def test_a_forced_function_call_is_a_function_call_item(url: str) -> None:
    response = client(url).responses.create(
        model="tiny",
        input="weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    # The conversation goes on with the call and its output.
    again = client(url).responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],  # fmt: skip
        max_output_tokens=4,
    )
    assert again.status in ("completed", "incomplete")


def test_a_client_leaving_mid_stream_leaves_nothing_held(url: str, cluster: Cluster) -> None:
    stream = client(url).responses.create(
        model="tiny", input=QUESTION, max_output_tokens=400, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()
    wait_baseline(cluster, 1)


def test_what_is_not_supported_is_a_400(url: str) -> None:
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="background"):
        c.responses.create(model="tiny", input="hi", background=True)
    with pytest.raises(openai.BadRequestError, match="function tools only"):
        c.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="hi")
    # A refusal names the Responses API's field, not the chat field it became.
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.create(model="tiny", input="hi", max_output_tokens=10**7)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "max_output_tokens", error
    assert "max_tokens" not in error["message"].replace("max_output_tokens", "")
    with pytest.raises(openai.BadRequestError) as caught:  # (max_completion_tokens, as chat)
        c.responses.create(model="tiny", input="hi", max_output_tokens=0)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "max_output_tokens", error
    assert "max_completion_tokens" not in error["message"], error
