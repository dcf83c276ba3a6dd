"""End to end through the real `openai` client: 1 prefill + 1 decode and 2 + 2, exact vs `LLM`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest
import requests

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.conftest import Cluster
from tests.integration.openai_shared import (
    MAX_TOKENS,
    PROMPTS,
    client,
    wait_baseline,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_models_and_health(base_url: str) -> None:
    models = client(base_url).models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]  # (conftest's two names)
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


def test_one_token_requests_end_on_prefill_exactly(
    base_url: str, cluster: Cluster, reference: LLM
) -> None:
    """max_tokens=1 needs no decode worker: nothing is reserved there and no page moves, and
    the answer (text, logprobs, usage, streamed or not, chat too) is the colocated one."""
    replicas = int(cluster.config["decode"]["replicas"])

    def counters() -> dict[str, int]:
        """Decode's prefix lookups (one per reservation) and prefill's bytes sent, per worker."""
        return {
            w["worker_id"]: w[
                "prefix_cache_queried_blocks" if w["role"] == "decode" else "kv_transfer_bytes"
            ]
            for w in wait_baseline(cluster, replicas)
        }

    before = counters()
    c = client(base_url)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    for prompt in PROMPTS[2:6]:
        exp = reference.generate([prompt], params, use_tqdm=False)[0]
        out = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=2
        )
        choice = out.choices[0]
        assert (choice.text, choice.finish_reason) == (exp.text, exp.finish_reason), prompt
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert choice.logprobs.token_logprobs[0] == pytest.approx(exp.logprobs[0][0], abs=1e-4)
        assert out.usage is not None and out.usage.completion_tokens == 1
        assert out.usage.prompt_tokens == len(exp.prompt_token_ids)
    stream = c.completions.create(
        model="tiny",
        prompt=PROMPTS[7],
        max_tokens=1,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    exp = reference.generate([PROMPTS[7]], params, use_tqdm=False)[0]
    assert text == exp.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1, temperature=0
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 1
    assert chat.choices[0].finish_reason in ("length", "stop")
    after = counters()  # (a replica of a previous deployment may have left meanwhile)
    kept = sorted(before.keys() & after.keys())
    assert any(w.startswith("decode") for w in kept) and any(w.startswith("prefill") for w in kept)
    assert [after[w] for w in kept] == [before[w] for w in kept]  # nothing reserved, sent
