"""Paged attention (reference and fast CPU path) vs dense SDPA on unpaged K/V."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

from tandem.kernels.backends import (
    KERNEL_BACKENDS,
    KernelBackend,
    get_attention_backend,
    get_kernel_backend,
    register_kernel_backend,
)
from tandem.kernels.dispatch import paged_attention_auto, write_kv_auto
from tandem.kernels.kv_cache import KVCachePool
from tandem.kernels.kv_write import write_kv
from tandem.kernels.paged_attention import paged_attention, paged_attention_reference
from tandem.kernels.testing import PagedBatch, dense_attention, make_paged_batch

FP32_TOL = 1e-5

# (context_lens, q_lens): contexts deliberately not multiples of the block sizes.
SCENARIOS: dict[str, tuple[list[int], list[int]]] = {
    "decode": ([1, 7, 33, 50, 17], [1, 1, 1, 1, 1]),
    "prefill_no_prefix": ([13, 40, 1], [13, 40, 1]),
    "prefill_with_prefix": ([29, 45], [9, 20]),
    "mixed": ([21, 5, 38, 64, 3, 19], [1, 5, 10, 1, 1, 19]),
}


def _run(fn: object, batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    assert callable(fn)
    out = fn(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        scale,
        sliding_window=window,
    )
    assert isinstance(out, torch.Tensor)
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_dense_sdpa_fp32(scenario: str, group: int, block_size: int) -> None:
    ctx, q_lens = SCENARIOS[scenario]
    kvh, head_dim = 2, 24  # head_dim is not hidden // heads of any usual model
    batch = make_paged_batch(
        ctx,
        q_lens,
        num_heads=kvh * group,
        num_kv_heads=kvh,
        head_dim=head_dim,
        block_size=block_size,
        seed=block_size * 10 + group,
    )
    scale = 1 / math.sqrt(head_dim)
    want = dense_attention(batch, scale)
    fast = _run(paged_attention, batch, scale)
    ref = _run(paged_attention_reference, batch, scale)
    assert _max_diff(fast, want) < FP32_TOL
    assert _max_diff(ref, want) < FP32_TOL
    assert _max_diff(fast, ref) < FP32_TOL


@pytest.mark.parametrize("window", [1, 4, 9, 1000])
@pytest.mark.parametrize("scenario", ["decode", "prefill_no_prefix", "mixed"])
def test_sliding_window_matches_dense_mask(window: int, scenario: str) -> None:
    ctx, q_lens = SCENARIOS[scenario]
    if scenario == "prefill_no_prefix":
        ctx, q_lens = [13, 40, 30], [13, 40, 12]  # include a cached prefix as well
    batch = make_paged_batch(
        ctx, q_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=window
    )
    want = dense_attention(batch, 0.3, sliding_window=window)
    assert _max_diff(_run(paged_attention, batch, 0.3, window), want) < FP32_TOL
    assert _max_diff(_run(paged_attention_reference, batch, 0.3, window), want) < FP32_TOL


def test_window_convention_is_transformers() -> None:
    """Our dense oracle's window mask equals transformers' causal + sliding overlay."""
    masking = pytest.importorskip("transformers.masking_utils")
    from tandem.kernels.testing import dense_mask

    window, q_len, ctx = 3, 5, 11
    fn = masking.and_masks(masking.causal_mask_function, masking.sliding_window_overlay(window))
    prefix = ctx - q_len
    hf = torch.tensor(
        [
            [bool(fn(*map(torch.tensor, (0, 0, prefix + i, j)))) for j in range(ctx)]
            for i in range(q_len)
        ]
    )
    assert torch.equal(hf, dense_mask(q_len, ctx, window))
    assert int(hf[-1].sum()) == window  # the last `window` positions, itself included


@pytest.mark.parametrize("scenario", ["decode", "mixed", "prefill_with_prefix"])
def test_bf16_close_to_fp32_and_to_hf_style_sdpa(scenario: str) -> None:
    ctx, q_lens = SCENARIOS[scenario]
    b16 = make_paged_batch(
        ctx, q_lens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=4,
        dtype=torch.bfloat16, seed=7,
    )  # fmt: skip
    pool32 = KVCachePool(b16.pool.num_blocks, 2, 4, 2, 32, dtype=torch.float32)
    pool32.tensor.copy_(b16.pool.tensor)  # the same bf16-representable values, in fp32
    b32 = dataclasses.replace(b16, pool=pool32, query=b16.query.float())
    scale = 32**-0.5
    fast = _run(paged_attention, b16, scale)
    assert fast.dtype == torch.bfloat16
    exact = _run(paged_attention_reference, b32, scale)
    assert _max_diff(fast.float(), exact) < 2e-2
    assert _max_diff(_run(paged_attention_reference, b16, scale).float(), exact) < 1e-2
    # transformers' sdpa path: SDPA on bf16 tensors with a dense mask.
    assert _max_diff(fast, dense_attention(b16, scale)) < 1e-2


def test_large_decode_batch_with_int32_tables_and_negative_padding() -> None:
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randint(100, 400, (64,), generator=gen).tolist()
    batch = make_paged_batch(
        ctx, [1] * 64, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        pad_value=-1, table_dtype=torch.int32,
    )  # fmt: skip
    tables_before = batch.block_tables.clone()
    want = dense_attention(batch, 0.125)
    assert _max_diff(_run(paged_attention, batch, 0.125), want) < FP32_TOL
    assert torch.equal(batch.block_tables, tables_before)  # inputs are never modified


@pytest.mark.parametrize("window", [None, 6])
def test_chunked_decode_path(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """Tiny chunk budget: decodes are sorted by length and run a few at a time."""
    module = importlib.import_module("tandem.kernels.paged_attention")
    monkeypatch.setattr(module, "DECODE_CHUNK_BYTES", 2 * 2 * 8 * 4 * 40 * 3)  # ~3 seqs
    ctx = [40, 3, 17, 29, 8, 40, 1, 22, 35, 12, 5]
    q_lens = [1] * len(ctx)
    q_lens[4] = 8  # one prefill in the middle of the decodes
    batch = make_paged_batch(
        ctx, q_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=11
    )
    want = dense_attention(batch, 0.4, sliding_window=window)
    assert _max_diff(_run(paged_attention, batch, 0.4, window), want) < FP32_TOL


def test_zero_length_queries_and_long_prefill_chunk() -> None:
    batch = make_paged_batch(
        [10, 300, 7, 260], [0, 1, 0, 200], num_heads=4, num_kv_heads=1, head_dim=8,
        block_size=16,
    )  # fmt: skip
    want = dense_attention(batch, 0.5)
    assert batch.query.shape[0] == 201
    assert _max_diff(_run(paged_attention, batch, 0.5), want) < FP32_TOL
    assert _max_diff(_run(paged_attention_reference, batch, 0.5), want) < FP32_TOL


def test_empty_batch() -> None:
    batch = make_paged_batch([], [], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    assert _run(paged_attention, batch, 1.0).shape == (0, 2, 8)


def test_shape_errors() -> None:
    batch = make_paged_batch([5], [1], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(
            batch.query[:, :3], batch.k_cache, batch.v_cache, batch.block_tables,
            batch.context_lens, batch.query_start_loc, 1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
            batch.context_lens, batch.query_start_loc[:1], 1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="q_len"):
        paged_attention_reference(
            batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
            torch.zeros_like(batch.context_lens), batch.query_start_loc, 1.0,
        )  # fmt: skip


def test_backend_registry() -> None:
    assert get_attention_backend() is paged_attention_auto
    assert get_kernel_backend().write_kv is write_kv_auto
    assert get_attention_backend("cpu") is paged_attention
    assert get_kernel_backend("cpu").write_kv is write_kv
    assert get_attention_backend("reference") is paged_attention_reference
    with pytest.raises(ValueError, match="known: auto, cpu, reference, triton"):
        get_kernel_backend("flash")
    with pytest.raises(ValueError, match="already"):
        register_kernel_backend("cpu", KernelBackend(paged_attention_reference, write_kv))
    with pytest.raises(ValueError, match="already"):
        register_kernel_backend("triton", KernelBackend(paged_attention_reference, write_kv))
    register_kernel_backend("test-only", KernelBackend(paged_attention_reference, write_kv))
    try:
        assert get_attention_backend("test-only") is paged_attention_reference
    finally:
        del KERNEL_BACKENDS["test-only"]
