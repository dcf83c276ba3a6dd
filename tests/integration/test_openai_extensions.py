"""The OpenAI API beyond one plain completion, end to end through the real `openai` client on
1 prefill + 1 decode and 2 + 2: several choices, logprobs, echo, penalties, structured output
and tool calls, each as the colocated engine gives it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.conftest import Cluster
from tests.integration.openai_shared import (
    MAX_TOKENS,
    PROMPTS,
    client,
    deploy_by_param,
    make_expected,
    make_reference,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> LLM:
    return make_reference(cluster)


@pytest.fixture(scope="module")
def expected(reference: LLM) -> list[Any]:
    return make_expected(reference)


@pytest.fixture(scope="module", params=["1x1", "2x2"])
def base_url(request: pytest.FixtureRequest, cluster: Cluster) -> str:
    return deploy_by_param(request, cluster)


def test_a_batch_of_prompts_with_n_choices_each(base_url: str, expected: list[Any]) -> None:
    """Choice i is sample i % n of prompt i // n; each is exact (greedy), and usage counts
    each prompt once."""
    c = client(base_url)
    extra = {"ignore_eos": True}
    out = c.completions.create(
        model="tiny",
        prompt=PROMPTS[:3],
        n=2,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
    )
    assert [ch.index for ch in out.choices] == list(range(6))
    assert [ch.text for ch in out.choices] == [expected[i // 2].text for i in range(6)]
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected[:3])
    assert out.usage.completion_tokens == 6 * MAX_TOKENS
    stream = c.completions.create(
        model="tiny",
        prompt=[PROMPTS[4], PROMPTS[14]],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    texts = ["", ""]
    chunks = list(stream)
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [expected[4].text, expected[14].text]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS


def test_logprobs_through_the_cluster_equal_the_colocated_engine_s(
    base_url: str, reference: LLM
) -> None:
    """Completions (streamed and not) and chat: each token's logprob and alternatives as the
    in-process engine computes them; the first token's come from the prefill worker."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    want = reference.generate([PROMPTS[6]], params, use_tqdm=False)[0]
    assert want.logprobs is not None
    want_lps = [lp for lp, _ in want.logprobs]
    tok = reference.engine.tokenizer
    c = client(base_url)
    common: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPTS[6],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    out = c.completions.create(**common)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs == pytest.approx(want_lps, abs=1e-4)
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.top_logprobs is not None and all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    stream = c.completions.create(**common, stream=True)
    streamed: list[float] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == pytest.approx(want_lps, abs=1e-4)
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPTS[6]}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


def test_echo_penalties_and_logit_bias(base_url: str, reference: LLM, expected: list[Any]) -> None:
    """`echo` puts the prompt's text before the completion (token id prompts too, streamed or
    not); penalties and `logit_bias` give the colocated engine's tokens."""
    c = client(base_url)
    extra = {"ignore_eos": True}
    out = c.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
        extra_body=extra,
    )
    assert out.choices[0].text == PROMPTS[2] + expected[2].text
    ids = expected[3].prompt_token_ids
    stream = c.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
        stream=True,
        extra_body=extra,
    )
    texts = [ch.choices[0].text for ch in stream if ch.choices]
    prompt_text = reference.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert texts[0] == prompt_text and "".join(texts[1:]) == expected[3].text
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        presence_penalty=0.8,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias={7: 2.5},
    )
    want = reference.generate([PROMPTS[5]], params, use_tqdm=False)[0]
    got = c.completions.create(
        model="tiny",
        prompt=PROMPTS[5],
        max_tokens=MAX_TOKENS,
        temperature=0,
        presence_penalty=0.8,
        frequency_penalty=0.3,
        logit_bias={"7": 2.5},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    assert got.choices[0].text == want.text and want.text != expected[5].text


def test_echo_with_logprobs_scores_the_prompt(base_url: str, reference: LLM) -> None:
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1): the prompt's tokens
    with their logprobs (the first null), then the completion's, as the in-process engine
    computes them; twice, the second time with the prompt cached on the workers."""
    prompt = "score this prompt token by token, as an evaluation harness does"
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    want = reference.generate([prompt], params, use_tqdm=False)[0]
    assert want.prompt_logprobs is not None and want.logprobs is not None
    want_lps = [None if e is None else e[0] for e in want.prompt_logprobs] + [want.logprobs[0][0]]
    tok = reference.engine.tokenizer
    for _ in range(2):
        out = client(base_url).completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        choice = out.choices[0]
        assert choice.text == prompt + want.text
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want_lps[1:], abs=1e-4)
        ids = want.prompt_token_ids + want.token_ids
        assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        assert lp.text_offset is not None and lp.text_offset[-1] == len(prompt)
    resp = requests.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1, "stream": True},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"


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


def test_stop_string_kept_with_include_stop_str_in_output(
    base_url: str, expected: list[Any]
) -> None:
    """vLLM's `include_stop_str_in_output`: the text ends with the stop string, streamed or not."""
    c = client(base_url)
    full = expected[2].text
    stop = full[len(full) // 3 : len(full) // 3 + 4]
    want = full[: full.find(stop) + len(stop)]
    body = {"include_stop_str_in_output": True, "ignore_eos": True}
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[2], "temperature": 0}
    kwargs.update(max_tokens=MAX_TOKENS, stop=[stop], extra_body=body)
    out = c.completions.create(**kwargs)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    stream = c.completions.create(stream=True, **kwargs)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want


def test_special_tokens_in_the_text_only_when_not_skipped(base_url: str, reference: LLM) -> None:
    """vLLM's `skip_special_tokens`: EOS (forced by a bias, generated past with `ignore_eos`)
    writes nothing by default and its own text with False; streamed or not."""
    hf = reference.engine.tokenizer.hf
    c = client(base_url)
    body = {"ignore_eos": True}
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "temperature": 0}
    kwargs.update(max_tokens=3, logit_bias={str(hf.eos_token_id): 100})
    assert c.completions.create(extra_body=body, **kwargs).choices[0].text == ""
    body["skip_special_tokens"] = False
    out = c.completions.create(extra_body=body, **kwargs)
    assert out.choices[0].text == hf.eos_token * 3
    stream = c.completions.create(stream=True, extra_body=body, **kwargs)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == hf.eos_token * 3


def test_truncate_prompt_tokens_keeps_the_prompts_end(base_url: str, reference: LLM) -> None:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens are the prompt (usage counts
    them), as the engine continues them; -1 keeps what fits next to max_tokens."""
    ids = reference.engine.tokenizer.encode(PROMPTS[3])
    assert len(ids) > 6
    want = reference.generate(
        [ids[-6:]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    c = client(base_url)
    body = {"truncate_prompt_tokens": 6, "ignore_eos": True}
    out = c.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=8, temperature=0, extra_body=body
    )
    assert out.choices[0].text == want.text
    assert out.usage is not None and out.usage.prompt_tokens == 6
    whole = c.completions.create(
        model="tiny",
        prompt=PROMPTS[3],
        max_tokens=8,
        temperature=0,
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)


def test_allowed_token_ids_and_bad_words_through_the_cluster(base_url: str, reference: LLM) -> None:
    """vLLM's `allowed_token_ids`: the prefill's first token and decode's others stay in the
    set, as the engine picks them."""
    allowed = [40, 41, 42, 97, 98]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    want = reference.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    body = {"allowed_token_ids": allowed, "ignore_eos": True}
    out = client(base_url).completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_body=body
    )
    assert out.choices[0].text == want.text and set(want.token_ids) <= set(allowed)
    words = [want.text[1:3]] if want.text[1:3].strip() else ["ab"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=words)
    want = reference.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    out = client(base_url).completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=6,
        temperature=0,
        extra_body={"bad_words": words, "ignore_eos": True},
    )
    assert out.choices[0].text == want.text  # (vLLM's bad_words, the same through the cluster)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "noop",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


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
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
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
    call = calls_streamed[0][0]
    assert call.function is not None and call.function.name in ("get_weather", "noop")
    assert isinstance(json.loads(call.function.arguments or ""), dict)
    # A conversation that goes on after the call: the tool's answer goes to the template.
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    ]
    again = c.chat.completions.create(model="tiny", messages=follow, max_tokens=4)  # type: ignore[arg-type]
    assert again.choices[0].finish_reason in ("length", "stop")
    # "auto" (the default with tools): the tiny model writes no call, so its text is the content
    auto = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=6)  # type: ignore[arg-type]
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    assert auto.choices[0].finish_reason == "length"


def test_auto_tool_calls_stream_the_content_before_the_call(base_url: str) -> None:
    """ "auto": a reply in the Hermes format (written here by a grammar, as a tool-trained
    model would) streams its content as it comes, then its call in the last chunk."""
    c = client(base_url)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    reply = f"Checking. <tool_call>{json.dumps(call)}</tool_call>"
    kwargs: dict[str, Any] = {"model": "tiny", "tools": TOOLS, "temperature": 0}
    kwargs.update(messages=[{"role": "user", "content": "weather in Oslo?"}], max_tokens=160)
    kwargs["extra_body"] = {"structured_outputs": {"grammar": f"root ::= {json.dumps(reply)}"}}
    out = c.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert message.tool_calls is not None
    got = [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls]  # type: ignore[union-attr]
    assert got == [("get_weather", {"city": "Oslo"})]
    deltas = [
        ch.choices[0] for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices
    ]
    contents = [d.delta.content for d in deltas if d.delta.content]
    assert "".join(contents) == "Checking. " and len(contents) > 1  # as it came
    streamed = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]
    assert len(streamed) == 1 and deltas[-1].finish_reason == "tool_calls"
    function = streamed[0][0].function
    assert function is not None and function.name == "get_weather"
    assert json.loads(function.arguments or "") == {"city": "Oslo"}
