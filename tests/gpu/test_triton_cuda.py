"""The Triton kernels and the engine on a real GPU (skipped without CUDA)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_auto_backend_on_cuda_matches_the_reference(dtype: torch.dtype, block_size: int) -> None:
    from tandem.kernels.backends import get_kernel_backend
    from tandem.kernels.paged_attention import paged_attention_reference
    from tandem.kernels.testing import make_paged_batch

    batch = make_paged_batch(
        [1, 37, 300, 64, 20], [1, 1, 40, 1, 20], num_heads=8, num_kv_heads=2, head_dim=64,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    caches = [c.cuda() for c in batch.pool.layer_cache(1)]
    args = [batch.query.cuda(), *caches, batch.block_tables.cuda(),
            batch.context_lens.cuda(), batch.query_start_loc.cuda(), 1 / math.sqrt(64)]  # fmt: skip
    got = get_kernel_backend("auto").attention(*args)
    want = paged_attention_reference(*[a.float() if i < 3 else a for i, a in enumerate(args)])
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol


def test_engine_on_cuda_equals_hf(tiny_checkpoint: Any) -> None:
    from tandem import LLM, SamplingParams
    from tests.hf_reference import hf_greedy, load_hf_model, random_prompts

    path = tiny_checkpoint(arch="llama", seed=1)
    hf = load_hf_model(path)
    prompts = random_prompts(8, hf.config.vocab_size, seed=5)
    ref = hf_greedy(hf, prompts, 16)
    llm = LLM(model=str(path), device="cuda", num_kv_blocks=256, max_num_batched_tokens=64)
    assert llm.engine.kv_pool.device.type == "cuda"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref


def test_sampling_on_cuda_is_seeded_and_mixes_with_every_other_kind(tiny_checkpoint: Any) -> None:
    """The filters run on the GPU for a batch without penalties, grammars or logprobs (the
    draws on the host); in a batch with them, their rows on the host and the others' on the
    GPU (`step_sampling`): both run, and agree where they must (a top-k of 1 is greedy; a
    seeded request repeats itself)."""
    from tandem import LLM, SamplingParams
    from tests.hf_reference import random_prompts

    path = tiny_checkpoint(arch="llama", seed=1)
    llm = LLM(model=str(path), device="cuda", num_kv_blocks=256)
    prompts = random_prompts(5, 256, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kinds = [
        greedy,
        SamplingParams(temperature=0.9, top_k=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=3, max_tokens=12),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=4, max_tokens=12),
        SamplingParams(temperature=1.0, seed=5, min_tokens=8, max_tokens=12),
    ]
    on_device = [o.token_ids for o in llm.generate(prompts, kinds)]
    again = [o.token_ids for o in llm.generate(prompts, kinds)]
    alone = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert on_device[2:] == again[2:]  # (seeded)
    assert on_device[0] == alone[0] and on_device[1] == alone[1]
    with_host = kinds + [SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True)]
    mixed = llm.generate([*prompts, prompts[0]], with_host)
    assert mixed[0].token_ids == alone[0] and mixed[5].token_ids == alone[0]
    assert all(1 <= len(o.token_ids) <= 12 for o in mixed[2:5]) and mixed[5].logprobs
