"""End to end through the real `openai` client: 1 prefill + 1 decode and 2 + 2, exact vs `LLM`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import openai
import pytest
import requests

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORDS = [
    "prefill",
    "decode",
    "router",
    "cache",
    "block",
    "token",
    "stream",
    "lease",
    "chunk",
    "page",
]
PROMPTS = [
    "hello",
    "The quick brown fox",
    "tandem serves prefill and decode on separate workers",
    "a b c d e f g",
    *(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + 9 * i)) for i in range(10)),
    "ünïcödé ça 語 界 ñ",
    "end.",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> LLM:
    return LLM(model=str(cluster.model), num_kv_blocks=512)


@pytest.fixture(scope="module")
def expected(reference: LLM) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return reference.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module", params=["1x1", "2x2"])
def base_url(request: pytest.FixtureRequest, cluster: Cluster) -> str:
    return cluster.deploy_pd(int(request.param[0]))


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def wait_baseline(cluster: Cluster, replicas: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """Every worker back to all blocks free, no request, no reservation, no transfer."""
    deadline = time.monotonic() + timeout
    workers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        workers = cluster.workers()
        roles = [w["role"] for w in workers]
        idle = all(
            w["num_free_blocks"] == w["num_blocks"]
            and w["num_requests"] == 0
            and w.get("num_reservations", 0) == 0
            and w.get("num_transfers", 0) == 0
            for w in workers
        )
        if idle and roles.count("prefill") == replicas and roles.count("decode") == replicas:
            return workers
        time.sleep(0.1)
    raise AssertionError(f"workers did not return to baseline: {workers}")


def test_models_and_health(base_url: str) -> None:
    models = client(base_url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
    assert requests.get(f"{base_url}/ping", timeout=10).status_code == 200
    assert requests.post(f"{base_url}/ping", timeout=10).status_code == 200


def test_completions_match_colocated_llm(base_url: str, expected: list[Any]) -> None:
    c = client(base_url)
    for prompt, exp in zip(PROMPTS, expected, strict=True):
        out = c.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == exp.text, prompt
        assert out.choices[0].finish_reason == "length"
        assert out.usage is not None
        assert out.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert out.usage.completion_tokens == len(exp.token_ids) == MAX_TOKENS
        assert out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


def test_streaming_completion_with_usage(base_url: str, expected: list[Any]) -> None:
    stream = client(base_url).completions.create(
        model="tiny",
        prompt=PROMPTS[5],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == expected[5].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(expected[5].prompt_token_ids),
        MAX_TOKENS,
    )


def test_chat_streaming_and_not(base_url: str, reference: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt_ids = reference.tokenizer.apply_chat_template(messages)
    exp = reference.generate(
        [prompt_ids], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
    )[0]
    c = client(base_url)
    out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert out.choices[0].message.content == exp.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(exp.token_ids)
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
        )  # type: ignore[arg-type]
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == exp.text
    assert chunks[-1].choices[0].finish_reason == exp.finish_reason


def test_stop_seed_and_timings(base_url: str, reference: LLM) -> None:
    prompt = PROMPTS[8]
    params = SamplingParams(
        temperature=0.9, top_p=0.8, top_k=50, seed=11, max_tokens=16, ignore_eos=True
    )
    exp = reference.generate([prompt], params, use_tqdm=False)[0]
    resp = requests.post(
        f"{base_url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "temperature": 0.9,
            "top_p": 0.8,
            "top_k": 50,
            "seed": 11,
            "max_tokens": 16,
            "ignore_eos": True,
            "user": "tester",
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == exp.text
    timings = resp.json()["tandem_timings"]
    assert {"ttft", "decode", "e2e"} <= set(timings)
    assert "ttft" in resp.headers["x-tandem-timings"]


def test_32_concurrent_streams_are_exact(base_url: str, expected: list[Any]) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.completions.create(
            model="tiny",
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(c, i) for i in range(32)))

    texts = asyncio.run(main())
    assert texts == [expected[i % len(PROMPTS)].text for i in range(32)]


def test_client_disconnect_cancels_and_frees_blocks(base_url: str, cluster: Cluster) -> None:
    _disconnect_mid_stream(base_url, cluster, n=1)


def test_client_disconnect_cancels_every_choice(base_url: str, cluster: Cluster) -> None:
    _disconnect_mid_stream(base_url, cluster, n=3)


def _disconnect_mid_stream(base_url: str, cluster: Cluster, n: int) -> None:
    replicas = int(cluster.config["decode"]["replicas"])
    before = {
        w["worker_id"]: w["num_cancelled"]
        for w in wait_baseline(cluster, replicas)
        if w["role"] == "decode"
    }
    body = {
        "model": "tiny",
        "prompt": PROMPTS[9],
        "max_tokens": 1800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "n": n,
    }
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6 * n)]
        assert any(line.startswith(b"data: {") for line in got)
    # Reports arrive within ~0.1 s, and right after a redeploy the registry may still list a
    # draining replica: count cancels per worker id, over every report seen, then wait for idle.
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 20
    while True:
        after = wait_baseline(cluster, replicas)
        for w in after:
            if w["role"] == "decode":
                seen[w["worker_id"]] = max(seen.get(w["worker_id"], 0), w["num_cancelled"])
        gained = sum(max(0, c - before.get(wid, 0)) for wid, c in seen.items())
        if gained >= n or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert gained == n, (before, seen, after)
    # the cluster still answers exactly afterwards
    out = client(base_url).completions.create(
        model="tiny", prompt="hello", max_tokens=4, temperature=0
    )
    assert out.usage is not None and out.usage.completion_tokens == 4


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
    arguments follow the function's parameters; streamed, it comes whole in one delta."""
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
