"""Test helpers: build a paged varlen batch from dense K/V, and the dense SDPA oracle.

Used by the kernel tests (and usable by engine tests). Not imported by the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels.kv_cache import KVCachePool
from tandem.kernels.kv_write import write_kv

__all__ = ["PagedBatch", "dense_attention", "dense_mask", "make_paged_batch"]


@dataclass
class PagedBatch:
    """A varlen batch laid out in a paged pool, plus the dense K/V it was built from."""

    pool: KVCachePool
    layer: int
    query: torch.Tensor  # (T, H, D)
    block_tables: torch.Tensor  # (B, max_blocks)
    context_lens: torch.Tensor  # (B,)
    query_start_loc: torch.Tensor  # (B + 1,)
    keys: list[torch.Tensor]  # per sequence (ctx, kvh, D)
    values: list[torch.Tensor]
    q_lens: list[int]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.pool.layer_cache(self.layer)[0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool.layer_cache(self.layer)[1]


def make_paged_batch(
    context_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int = 2,
    layer: int = 1,
    spare_blocks: int = 3,
    pad_value: int | None = None,
    table_dtype: torch.dtype = torch.int64,
) -> PagedBatch:
    """Random Q/K/V for ``B`` sequences, K/V placed in shuffled, non-contiguous blocks.

    The whole pool starts as random garbage (so reading an unmasked padding or foreign
    slot shows up). The cached prefix is written by direct indexing and the new tokens'
    K/V through ``write_kv``, as the engine does. Block-table padding is ``pad_value``,
    or a random valid block id when None.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = KVCachePool(num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype=dtype)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
    k_cache, v_cache = pool.layer_cache(layer)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
    if pad_value is not None:
        tables.fill_(pad_value)
    keys, values, queries, slots_new = [], [], [], []
    k_new, v_new = [], []
    for b, (ctx, q_len) in enumerate(zip(context_lens, q_lens, strict=True)):
        if not 0 <= q_len <= ctx:
            raise ValueError(f"sequence {b}: q_len {q_len} vs context {ctx}")
        ids = perm[: blocks_per_seq[b]]
        perm = perm[blocks_per_seq[b] :]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        pos = torch.arange(ctx)
        slots = torch.tensor(ids, dtype=torch.int64)[pos // block_size] * block_size
        slots += pos % block_size
        prefix = ctx - q_len
        blk, off = slots[:prefix] // block_size, slots[:prefix] % block_size
        k_cache[blk, off] = k[:prefix]
        v_cache[blk, off] = v[:prefix]
        slots_new.append(slots[prefix:])
        k_new.append(k[prefix:])
        v_new.append(v[prefix:])
    if k_new:
        write_kv(k_cache, v_cache, torch.cat(k_new), torch.cat(v_new), torch.cat(slots_new))
    queries.append(torch.empty(0, num_heads, head_dim, dtype=dtype))
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(list(q_lens), dtype=torch.int64), 0)
    return PagedBatch(
        pool=pool,
        layer=layer,
        query=torch.cat(queries),
        block_tables=tables.to(table_dtype),
        context_lens=torch.tensor(list(context_lens), dtype=torch.int64),
        query_start_loc=qsl,
        keys=keys,
        values=values,
        q_lens=list(q_lens),
    )


def dense_mask(q_len: int, ctx: int, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean ``(q_len, ctx)``: query row ``i`` sits at position ``ctx - q_len + i``."""
    prefix = ctx - q_len
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=prefix)
    if sliding_window is not None:
        mask &= torch.ones(q_len, ctx, dtype=torch.bool).triu(prefix - sliding_window + 1)
    return mask


def dense_attention(
    batch: PagedBatch, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """The oracle: per sequence, SDPA on the contiguous (unpaged) K/V, repeated to all
    heads, with a dense causal (optionally windowed) mask; in the inputs' dtype."""
    outs = []
    num_heads = batch.query.shape[1]
    start = 0
    for k, v, q_len in zip(batch.keys, batch.values, batch.q_lens, strict=True):
        q = batch.query[start : start + q_len]
        start += q_len
        group = num_heads // k.shape[1]
        mask = dense_mask(q_len, k.shape[0], sliding_window)
        # 4-D (1, heads, len, dim) like transformers' sdpa_attention_forward, so that
        # in bf16 the same CPU SDPA kernel (flash, float accumulation) is used.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.repeat_interleave(group, 1).transpose(0, 1)[None],
            v.repeat_interleave(group, 1).transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else batch.query.new_empty(batch.query.shape)
