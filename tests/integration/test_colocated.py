"""Colocated mode: no prefill workers; decode workers prefill (unchunked here) and decode, exact."""

from __future__ import annotations

import openai
import pytest
import requests

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["hello", " ".join(f"word{i}" for i in range(40)), "a b c d e f g h i j k l m n o p"]


def test_colocated_workers_without_chunked_prefill_match_the_engine(cluster: Cluster) -> None:
    base_url = cluster.deploy(
        mode="colocated",
        engine={
            "num_kv_blocks": 512,
            "max_num_batched_tokens": 32,
            "enable_chunked_prefill": False,
        },
        decode={"replicas": 2, "num_cpus": 0.25},
    )
    health = requests.get(f"{base_url}/health", timeout=10).json()
    assert health == {"status": "ok", "workers": {"decode": 2}}
    assert {w["role"] for w in cluster.workers()} == {"decode"}

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(model=str(cluster.model), num_kv_blocks=512).generate(
        PROMPTS, params, use_tqdm=False
    )
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == ref.text
        assert out.usage is not None and out.usage.completion_tokens == 8
    long_prompt = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=2)
    usage = long_prompt.usage.model_dump() if long_prompt.usage else {}
    assert usage["prompt_tokens"] > 32  # over the step budget: prefilled whole, in one step
    assert usage["kv_transferred_blocks"] == 0
    # Logprobs, and the prompt's with echo, from a worker that prefilled the request itself.
    ref_lp = LLM(model=str(cluster.model), num_kv_blocks=512).generate(
        [PROMPTS[2]],
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    assert ref_lp.logprobs is not None and ref_lp.prompt_logprob_entries is not None
    scored = client.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=3,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    want = [None] + [e[0] for e in ref_lp.prompt_logprob_entries[1:] if e is not None]
    want += [e[0] for e in ref_lp.logprobs]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
