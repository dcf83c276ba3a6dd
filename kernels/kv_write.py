"""Writing new tokens' K/V into the paged cache (runs once per layer per step)."""

from __future__ import annotations

import torch

__all__ = ["check_write_shapes", "write_kv"]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into the cache slots named by ``slot_mapping``, in place.

    Args:
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, typically the
            strided per-layer views of ``KVCachePool.layer_cache`` (any strides work).
        key, value: ``(T, num_kv_heads, head_dim)``; cast to the cache dtype if they differ.
        slot_mapping: ``(T,)`` integer tensor, ``slot = block_id * block_size + offset``.
            Every slot must lie in ``[0, num_blocks * block_size)`` and slots should be
            distinct (with duplicates, which row wins is unspecified). Slots are not
            range-checked here, to keep the hot path free of reductions.

    Only the ``T`` addressed ``(block, offset)`` rows of each cache are written; no other
    byte of the pool changes.
    """
    check_write_shapes(k_cache, v_cache, key, value, slot_mapping)
    if key.shape[0] == 0:
        return
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    # Two index tensors -> one index_put_ per cache; measured as fast as a flattened-row
    # index_copy_ over an as_strided view for T in [64, 2048] on CPU, and simpler.
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    index = (blocks, offsets)
    k_cache.index_put_(index, key.to(k_cache.dtype))
    v_cache.index_put_(index, value.to(v_cache.dtype))


def check_write_shapes(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Metadata-only checks shared by every KV-write implementation (no tensor reads)."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} must match, 3-D")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache must match, 4-D")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key heads/dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be ({key.shape[0]},)")
