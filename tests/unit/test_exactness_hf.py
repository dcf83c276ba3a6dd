"""tandem's greedy tokens equal transformers' for all four architectures, in every engine mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_last_logits, load_hf_model, random_prompts

MAX_TOKENS = 32
NUM_PROMPTS = 16

ARCH_CASES: dict[str, dict[str, Any]] = {
    # GQA 4:2 and llama3 rope scaling
    "llama": dict(
        arch="llama",
        seed=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k/v biases, GQA 4:1
    "qwen2": dict(arch="qwen2", seed=2, kv_heads=1),
    # q/k norms, head_dim (32) != hidden / heads (16)
    "qwen3": dict(arch="qwen3", seed=3, head_dim=32),
    # tied embeddings and a sliding window shorter than the prompts
    "mistral": dict(arch="mistral", seed=4, tie_embeddings=True, sliding_window=48),
}

# Every budget with prefix caching on and off, plus a pool small enough to force preemption.
ENGINE_MODES: dict[str, dict[str, Any]] = {
    f"{'prefix' if prefix else 'no-prefix'}-{name}": dict(enable_prefix_caching=prefix, **kwargs)
    for prefix in (True, False)
    for name, kwargs in {
        "chunk-16": dict(max_num_batched_tokens=16),
        "chunk-64": dict(max_num_batched_tokens=64),
        "chunk-4096": dict(max_num_batched_tokens=4096),
        "preempting": dict(num_kv_blocks=40, max_model_len=400, max_num_batched_tokens=4096),
    }.items()
}


@pytest.fixture(scope="module", params=sorted(ARCH_CASES))
def arch_case(request: pytest.FixtureRequest, tiny_checkpoint: Any) -> dict[str, Any]:
    path: Path = tiny_checkpoint(**ARCH_CASES[request.param])
    hf = load_hf_model(path)
    prompts = random_prompts(NUM_PROMPTS, hf.config.vocab_size, seed=7)
    return {"path": path, "hf": hf, "prompts": prompts, "ref": hf_greedy(hf, prompts, MAX_TOKENS)}


@pytest.mark.parametrize("mode", sorted(ENGINE_MODES))
def test_greedy_tokens_equal_hf(arch_case: dict[str, Any], mode: str) -> None:
    kwargs = {"num_kv_blocks": 512, **ENGINE_MODES[mode]}
    llm = LLM(model=str(arch_case["path"]), **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(arch_case["prompts"], params)
    got = [o.token_ids for o in outs]
    mismatched = [i for i, (g, r) in enumerate(zip(got, arch_case["ref"], strict=True)) if g != r]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert [o.finish_reason for o in outs] == ["length"] * NUM_PROMPTS
    assert [o.prompt_token_ids for o in outs] == arch_case["prompts"]
    if mode.endswith("preempting"):
        assert llm.engine.num_preemptions > 0
    if mode == "prefix-chunk-4096":
        # The same prompts again: now served mostly from the prefix cache, with the same tokens.
        again = llm.generate(arch_case["prompts"], params)
        assert [o.token_ids for o in again] == arch_case["ref"]
        assert sum(o.num_cached_tokens for o in again) >= sum(
            len(p) // 16 * 16 - 16 for p in arch_case["prompts"]
        )
    if mode.startswith("no-prefix"):
        assert all(o.num_cached_tokens == 0 for o in outs)
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_first_step_logits_match_hf(arch_case: dict[str, Any]) -> None:
    llm = LLM(model=str(arch_case["path"]), num_kv_blocks=512)
    engine = llm.engine
    prompts = arch_case["prompts"][:8]
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == len(prompts)
    logits, reqs = engine.runner.execute(out)
    assert [r.prompt_token_ids for r in reqs] == prompts
    for row, prompt in zip(logits, prompts, strict=True):
        ref = hf_last_logits(arch_case["hf"], prompt)
        assert torch.allclose(row, ref, atol=1e-4, rtol=0), (row - ref).abs().max()


def test_bfloat16_matches_hf_bfloat16(tiny_checkpoint: Any) -> None:
    path = tiny_checkpoint(**ARCH_CASES["llama"])
    hf = load_hf_model(path, dtype=torch.bfloat16)
    prompts = random_prompts(NUM_PROMPTS, hf.config.vocab_size, seed=11)
    ref = hf_greedy(hf, prompts, MAX_TOKENS)
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=512)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    same = sum(
        a == b for o, r in zip(outs, ref, strict=True) for a, b in zip(o.token_ids, r, strict=True)
    )
    assert same / (NUM_PROMPTS * MAX_TOKENS) >= 0.9, (
        f"only {same} of {NUM_PROMPTS * MAX_TOKENS} tokens match"
    )
