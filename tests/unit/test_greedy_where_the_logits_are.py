"""A batch of plain greedy requests takes its tokens by an argmax where the logits are (a GPU's,
so that only token ids cross to the host); any other batch goes through the host sampler. On
this CPU-only machine the logits are made to look as if they were on a device."""

from __future__ import annotations

from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine import llm_engine, sampler
from tests.hf_reference import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(model=str(tiny_checkpoint(arch="llama", seed=21)), num_kv_blocks=512)


def _host_sampler_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    host_sample = llm_engine.sample

    def counting(logits: Any, requests: Any, extra: Any = ()) -> list[int]:
        calls.append(len(requests))
        return host_sample(logits, requests, extra)

    monkeypatch.setattr(llm_engine, "sample", counting)
    return calls


def test_plain_greedy_batches_never_reach_the_host_sampler_and_give_the_same_tokens(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(6, 256, seed=3, max_len=30)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    third = llm.generate(prompts[:1], plain, use_tqdm=False)[0].outputs[0].token_ids[2]
    # A stop token the first prompt's greedy output meets third, held back until the sixth.
    held = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[third])
    params = [plain, held]
    expected = [llm.generate(prompts, p, use_tqdm=False) for p in params]
    assert len(expected[1][0].outputs[0].token_ids) >= 6
    calls = _host_sampler_calls(monkeypatch)
    monkeypatch.setattr(sampler, "_on_host", lambda logits: False)
    got = [llm.generate(prompts, p, use_tqdm=False) for p in params]
    assert calls == []
    for want, have in zip(expected, got, strict=True):
        assert [o.outputs[0].token_ids for o in have] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize(
    "other",
    [
        SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=4, ignore_eos=True),
    ],
    ids=["sampled", "logprobs", "penalty"],
)
def test_a_batch_with_any_other_request_goes_to_the_host_sampler(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, other: SamplingParams
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(2, 256, seed=4, max_len=20)
    expected = llm.generate(prompts, [greedy, other], use_tqdm=False)
    calls = _host_sampler_calls(monkeypatch)
    monkeypatch.setattr(sampler, "_on_host", lambda logits: False)
    got = llm.generate(prompts, [greedy, other], use_tqdm=False)
    assert calls and all(n == 2 for n in calls)  # (every step had both requests)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert got[1].outputs[0].token_ids == expected[1].outputs[0].token_ids
