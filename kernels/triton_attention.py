"""Paged attention in Triton: one kernel for prefill/mixed batches, split-K for decode.

Same contract as ``tandem.kernels.paged_attention`` (read its docstring): varlen queries,
a block table per sequence, the new tokens' K/V already in the cache, causal with an optional
sliding window, GQA by ``num_heads // num_kv_heads`` query heads per KV head.

Kernels (in ``triton_attention_kernels``)
-----------------------------------------
* ``varlen_kernel`` (prefill chunks over a cached prefix, mixed batches): one program per
  (sequence, tile of ``BLOCK_Q`` query tokens, KV head). Its rows are the ``BLOCK_Q`` tokens x
  the query heads sharing that KV head, so each K/V tile is loaded once for the whole group.
  Keys are visited in tiles of ``BLOCK_N`` token positions; the physical block of each position
  is looked up in the block table, so any block size works (a power of two >= ``BLOCK_N`` keeps
  every tile inside one block). Online softmax in float32.
* ``decode_kernel`` + ``combine_kernel`` (every sequence has one new token): flash-decoding.
  One program per (sequence, KV head, split); each split walks its share of the context and
  writes an unnormalised partial result with its running max and sum, which the combine kernel
  merges. With one split the decode kernel normalises and writes the output itself.

Numerics follow flash attention: q.k and the softmax in float32; probabilities rounded to the
input dtype before p.v (accumulated in float32); the output rounded once. float32 inputs use
IEEE dots (no TF32). Under the Triton interpreter (``TRITON_INTERPRET=1``, tensors on the
CPU) half-precision dots are emulated in float32 after the same roundings, because the
interpreter's bf16 arithmetic is wrong; its float32 -> bfloat16 casts truncate instead of
rounding to nearest, so interpreted bf16 results differ from the GPU's by an ulp here and there.
"""

from __future__ import annotations

import functools

import torch
import triton

from tandem.kernels.paged_attention import check_shapes
from tandem.kernels.triton_attention_kernels import combine_kernel, decode_kernel, varlen_kernel

__all__ = ["paged_attention_triton"]

LOG2E = 1.4426950408889634


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


def _tile_size(block_size: int) -> int:
    """Key tile of the varlen kernel: the block itself when it is a power of two in [16, 64],
    else 32 positions (a tile then spans blocks; positions look their block up one by one)."""
    if block_size & (block_size - 1) == 0 and 16 <= block_size <= 64:
        return block_size
    return 32


DECODE_TILE = 64
"""Key positions per decode-loop iteration: bigger loads in flight than one 16-token block."""


DECODE_PROGRAMS_PER_SM = 8
"""Decode programs per SM to aim for: each holds only a few loads in flight, so an SM needs
several to keep HBM busy (one sequence at 128K positions reached 43 % of copy bandwidth with 2)."""

MAX_SPLITS = 256
MIN_SPLIT_POSITIONS = 256
COMBINE_CHUNK = 32


@functools.cache
def _sm_count(index: int | None) -> int:
    return int(torch.cuda.get_device_properties(index or 0).multi_processor_count)


def _num_splits(
    batch: int, kv_heads: int, max_context: int, device: torch.device, per_sm: int | None = None
) -> int:
    """Enough programs for ``per_sm`` per SM, but no split under 256 positions."""
    if device.type != "cuda":
        return 1 if max_context <= MIN_SPLIT_POSITIONS else 2  # interpreter: both paths
    per_sm = per_sm or DECODE_PROGRAMS_PER_SM
    want = -(-per_sm * _sm_count(device.index) // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_context // MIN_SPLIT_POSITIONS), MAX_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton paged attention (contract: ``tandem.kernels.paged_attention``).

    ``max_query_len`` / ``max_context_len`` are host-side hints (the engine knows them); when
    absent they are read from the tensors, which synchronises with the device. ``num_splits``
    overrides the decode split count (tests)."""
    check_shapes(
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, sliding_window
    )
    out = torch.empty_like(query)
    batch = block_tables.shape[0]
    if query.shape[0] == 0 or batch == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    upcast = query.device.type == "cpu"
    scalars = (scale * LOG2E, sliding_window or 0, block_size)
    strides = (
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
    )
    head_pad = _pow2(head_dim, 16)
    consts = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_PAD": head_pad,
        "HAS_WINDOW": sliding_window is not None,
        "UPCAST": upcast,
        "IEEE": query.dtype == torch.float32,
    }
    if max_query_len > 1:
        group_pad = _pow2(group)
        block_q = max(1, 64 // group_pad) if max_query_len >= 64 else max(1, 16 // group_pad)
        grid = (batch, triton.cdiv(max_query_len, block_q), num_kv_heads)
        varlen_kernel[grid](
            query, k_cache, v_cache, out, block_tables, context_lens, query_start_loc,
            *scalars, *strides,
            GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=_tile_size(block_size), **consts,
        )  # fmt: skip
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    splits = num_splits or _num_splits(batch, num_kv_heads, max_context_len, query.device)
    if splits > 1:
        part_o = torch.empty(
            (batch, num_heads, splits, head_pad), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (batch, num_heads, splits, 2), dtype=torch.float32, device=query.device
        )
    else:
        part_o = part_ml = out  # unused
    decode_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, out, part_o, part_ml, block_tables, context_lens,
        query_start_loc, *scalars, num_heads, splits, *strides,
        ROWS=_pow2(group, 16), ONE_SPLIT=splits == 1, BLOCK_N=DECODE_TILE, **consts,
    )  # fmt: skip
    if splits > 1:
        combine_kernel[(batch, num_heads)](
            out, part_o, part_ml, query_start_loc, num_heads, splits, *out.stride(),
            SPLITS_PAD=_pow2(splits), CHUNK=min(_pow2(splits), COMBINE_CHUNK),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        )  # fmt: skip
    return out
