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
