"""2 prefill + 2 decode: prefixes are found where they live, conversations reuse decode KV."""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]
DEPLOYMENT = "2x2"  # (conftest groups the tests by deployment)

BS = 16


@pytest.fixture(scope="module")
def base_url(cluster: Cluster) -> str:
    url = cluster.deploy_pd(2)
    deadline = time.monotonic() + 30
    while len(cluster.workers()) < 4:  # every worker registered (and its events followed)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)
    return url


@pytest.fixture(scope="module")
def llm(cluster: Cluster) -> LLM:
    return LLM(model=str(cluster.model), num_kv_blocks=512)


def ids(seed: int, n: int) -> list[int]:
    return [10 + (seed * 7919 + i * 31) % 480 for i in range(n)]


def complete(base_url: str, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def prefill_hits(cluster: Cluster) -> dict[str, int]:
    return {
        w["worker_id"]: w["prefix_cache_hit_blocks"]
        for w in cluster.workers()
        if w["role"] == "prefill"
    }


def expected_text(llm: LLM, prompt: list[int], max_tokens: int = 8) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return str(llm.generate([prompt], params, use_tqdm=False)[0].text)


def test_shared_prefix_goes_to_the_prefill_worker_that_holds_it(
    base_url: str, cluster: Cluster, llm: LLM
) -> None:
    prefix = ids(1, 20 * BS)  # 20 full blocks
    before = prefill_hits(cluster)
    first = prefix + ids(2, 150)  # a tail longer than conditional prefill's limit
    assert complete(base_url, first)["choices"][0]["text"] == expected_text(llm, first)
    time.sleep(0.5)  # the index hears of the new blocks
    # two follow-ups: more would (rightly) trip the imbalance guard of a 2-worker group
    for q in range(3, 5):
        prompt = prefix + ids(q, 150)
        assert complete(base_url, prompt)["choices"][0]["text"] == expected_text(llm, prompt)
    # both follow-ups hit the 20 prefix blocks, on one worker (stats arrive within ~0.5 s)
    deadline = time.monotonic() + 5
    while True:
        gained = {w: n - before.get(w, 0) for w, n in prefill_hits(cluster).items()}
        if sorted(gained.values()) == [0, 2 * 20] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(gained.values()) == [0, 2 * 20], gained


def test_conversation_reuses_decode_kv_and_short_follow_up_transfers_nothing(
    base_url: str, llm: LLM
) -> None:
    turn1 = ids(11, 200)
    out1 = complete(base_url, turn1, 16)
    t1_ids = llm.generate(
        [turn1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    assert out1["choices"][0]["text"] == expected_text(llm, turn1, 16)
    assert out1["usage"]["kv_transferred_blocks"] == -(-len(turn1) // BS)
    time.sleep(0.5)
    turn2 = turn1 + t1_ids + ids(12, 160)
    out2 = complete(base_url, turn2, 16)
    assert out2["choices"][0]["text"] == expected_text(llm, turn2, 16)
    prompt_blocks = -(-len(turn2) // BS)
    assert 0 < out2["usage"]["kv_transferred_blocks"] < prompt_blocks
    assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(turn1) // BS * BS
    t2_ids = llm.generate(
        [turn2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    time.sleep(0.5)
    turn3 = turn2 + t2_ids + ids(13, 12)
    out3 = complete(base_url, turn3, 16)
    assert out3["choices"][0]["text"] == expected_text(llm, turn3, 16)
    assert out3["usage"]["kv_transferred_blocks"] == 0
    assert out3["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(turn2) // BS * BS
