"""The @triton.jit kernels behind `triton_attention.paged_attention_triton` (which documents
what they compute and how they are launched).

* ``varlen_kernel``: prefill chunks over a cached prefix and mixed batches, one program per
  (sequence, tile of ``BLOCK_Q`` query tokens, KV head);
* ``decode_kernel`` + ``combine_kernel``: split-K decode, one program per (sequence, KV head,
  split), then the merge of the splits' partial results.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine_kernel", "decode_kernel", "varlen_kernel"]


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_kv_tiles(
    k_ptr,
    v_ptr,
    table_row_ptr,
    stride_tn,
    kpos,
    valid,
    kv_head,
    dims,
    dim_ok,
    block_size,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
):
    """K and V rows (BLOCK_N, HEAD_PAD) of one KV head at token positions ``kpos`` (0 where
    invalid): each position's block is looked up in the table once for both."""
    block = tl.load(table_row_ptr + (kpos // block_size) * stride_tn, mask=valid, other=0)
    block = tl.maximum(block, 0).to(tl.int64)
    offset = kpos % block_size
    mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(
        k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh
        + dims[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )  # fmt: skip
    v = tl.load(
        v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
        + dims[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )  # fmt: skip
    return k, v


@triton.jit
def _softmax_step(
    q, k, v, allowed, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr
):
    """One key tile of online softmax (base 2): returns the updated running max, sum and
    unnormalised output. Rows with no allowed key yet keep max -inf and contribute nothing."""
    s = _dot(q, tl.trans(k), UPCAST, IEEE) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
    return m_new, l_i, acc


@triton.jit
def varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    tables_ptr,
    ctx_ptr,
    qsl_ptr,
    qk_scale,  # scale * log2(e): scores live in base 2
    window,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_tb,
    stride_tn,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = (tl.load(qsl_ptr + seq + 1) - q_start).to(tl.int32)
    first = q_tile * BLOCK_Q
    if first >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = first + rows // GROUP_PAD
    member = rows % GROUP_PAD
    row_ok = (tok < q_len) & (member < GROUP)
    head = kv_head * GROUP + member
    pos = ctx - q_len + tok  # each row's token position
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = q_start + tok
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    hi = ctx - q_len + tl.minimum(first + BLOCK_Q, q_len)  # keys below this position
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - q_len + first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        valid = kpos < hi
        k, v = _load_kv_tiles(
            k_ptr, v_ptr, table_row, stride_tn, kpos, valid, kv_head, dims, dim_ok, block_size,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        )  # fmt: skip
        allowed = (kpos[None, :] <= pos[:, None]) & valid[None, :]
        if HAS_WINDOW:
            allowed = allowed & (kpos[None, :] > pos[:, None] - window)
        m_i, l_i, acc = _softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, UPCAST, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    part_o_ptr,  # (B, H, num_splits, HEAD_PAD) float32, when num_splits > 1
    part_ml_ptr,  # (B, H, num_splits, 2) float32: running max and sum (base 2)
    tables_ptr,
    ctx_ptr,
    qsl_ptr,
    qk_scale,
    window,
    block_size,
    num_heads,
    num_splits,  # a runtime value: each new count would otherwise compile a new kernel
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_tb,
    stride_tn,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    ONE_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(qsl_ptr + seq).to(tl.int64)
    if tl.load(qsl_ptr + seq + 1) == q_row:  # no new token: the sequence has no output row
        return
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    member = tl.arange(0, ROWS)
    row_ok = member < GROUP
    head = kv_head * GROUP + member
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + q_row * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    # This split's share of [lo, ctx), in whole tiles.
    tiles = tl.cdiv(ctx - lo, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    begin = lo + split * per_split * BLOCK_N
    end = tl.minimum(begin + per_split * BLOCK_N, ctx)
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for start in range(begin, end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        valid = kpos < end
        k, v = _load_kv_tiles(
            k_ptr, v_ptr, table_row, stride_tn, kpos, valid, kv_head, dims, dim_ok, block_size,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        )  # fmt: skip
        allowed = valid[None, :]
        m_i, l_i, acc = _softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, UPCAST, IEEE)
    if ONE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + q_row * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        part = (seq.to(tl.int64) * num_heads + head) * num_splits + split  # (ROWS,)
        tl.store(part_o_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def combine_kernel(
    o_ptr,
    part_o_ptr,
    part_ml_ptr,
    qsl_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
    CHUNK: tl.constexpr,  # splits merged per loop step (keeps CHUNK x HEAD_PAD in registers)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(qsl_ptr + seq).to(tl.int64)
    if tl.load(qsl_ptr + seq + 1) == q_row:
        return
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    every = tl.arange(0, SPLITS_PAD)
    m_all = tl.load(part_ml_ptr + (base + every) * 2, mask=every < num_splits, other=float("-inf"))
    m_max = tl.max(m_all, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    dims = tl.arange(0, HEAD_PAD)
    out = tl.zeros([HEAD_PAD], tl.float32)
    total = tl.zeros([CHUNK], tl.float32)
    for first in range(0, num_splits, CHUNK):
        splits = first + tl.arange(0, CHUNK)
        split_ok = splits < num_splits
        m = tl.load(part_ml_ptr + (base + splits) * 2, mask=split_ok, other=float("-inf"))
        l_part = tl.load(part_ml_ptr + (base + splits) * 2 + 1, mask=split_ok, other=0.0)
        weight = tl.exp2(m - m_safe)  # 0 for empty splits (m = -inf)
        acc = tl.load(
            part_o_ptr + (base + splits)[:, None] * HEAD_PAD + dims[None, :],
            mask=split_ok[:, None],
            other=0.0,
        )
        total += weight * l_part
        out += tl.sum(acc * weight[:, None], 0)
    denom = tl.sum(total, 0)
    out = out / tl.where(denom > 0, denom, 1.0)
    tl.store(
        o_ptr + q_row * stride_ot + head * stride_oh + dims * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
