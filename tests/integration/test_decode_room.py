"""More requests than the decode worker's KV pool holds at once: those without room wait their
turn for it (as in vLLM's queue) instead of a 429, and every answer is exact."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tests.integration.conftest import Cluster
from tests.integration.openai_shared import client, wait_baseline

pytestmark = [pytest.mark.ray, pytest.mark.slow]
DEPLOYMENT = "1x1"  # (conftest groups the tests by deployment)

REQUESTS = 16
PROMPT_TOKENS = 1900  # 119 blocks each: the decode worker's 512 blocks hold 4 at once


def prompt(seed: int) -> list[int]:
    return [10 + (seed * 7919 + i * 13) % 480 for i in range(PROMPT_TOKENS)]


def test_requests_beyond_decode_room_wait_for_it_and_are_exact(
    cluster: Cluster, reference: LLM
) -> None:
    base_url = cluster.deploy_pd(1)
    c = client(base_url)
    prompts = [prompt(seed) for seed in range(REQUESTS)]

    def one(ids: list[int]) -> Any:
        out = c.completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return out.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        got = list(pool.map(one, prompts))  # (a 429 raises openai.RateLimitError)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = reference.generate(prompts, params, use_tqdm=False)
    assert got == [e.token_ids for e in expected]
    wait_baseline(cluster, 1)


def test_choices_beyond_decode_room_wait_their_turns_and_are_exact(
    cluster: Cluster, reference: LLM
) -> None:
    """A batch of prompts larger than the decode worker's pool completes (its choices wait
    their turns one by one, those granted run meanwhile), and so do concurrent n > 1 ones."""
    base_url = cluster.deploy_pd(1)
    c = client(base_url)
    batch = [prompt(100 + seed) for seed in range(6)]
    fields: dict[str, Any] = {"max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}

    def choices(prompts: list[list[int]], n: int) -> list[Any]:
        out = c.completions.create(
            model="tiny", prompt=prompts, n=n, extra_body=extra, **fields
        )  # (a 429 raises openai.RateLimitError)
        return [ch.token_ids for ch in sorted(out.choices, key=lambda ch: ch.index)]

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert choices(batch, 1) == [e.token_ids for e in reference.generate(batch, params)]
    pairs = [prompt(200 + seed) for seed in range(4)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        got = list(pool.map(lambda ids: choices([ids], 2), pairs))
    expected = reference.generate(pairs, params)
    assert got == [[e.token_ids, e.token_ids] for e in expected]
    wait_baseline(cluster, 1)
