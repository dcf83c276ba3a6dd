"""The KV-cache write in Triton: store each new token's K/V rows into its slot.

Same contract as ``tandem.kernels.kv_write.write_kv``; additionally a negative slot means
"skip this row" (padding). One program per token copies its ``num_kv_heads x head_dim`` K and
V values (cast to the cache dtype first, by torch, when they differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.kv_write import check_write_shapes

__all__ = ["write_kv_triton"]


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_xd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(
        key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
        mask=mask,
    )
    k_dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch
    v_dst = block * stride_xb + offset * stride_xs + heads[:, None] * stride_xh
    tl.store(
        k_cache_ptr + k_dst + dims[None, :] * stride_cd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + v_dst + dims[None, :] * stride_xd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots in place (see ``write_kv``)."""
    check_write_shapes(k_cache, v_cache, key, value, slot_mapping)
    tokens = key.shape[0]
    if tokens == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    # Cast here, not in the kernel: torch rounds to nearest even, and the Triton interpreter
    # truncates float32 -> bfloat16. The engine's K/V already have the cache dtype.
    key = key.to(k_cache.dtype)
    value = value.to(v_cache.dtype)
    _write_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
