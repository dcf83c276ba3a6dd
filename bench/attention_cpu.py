"""Micro-benchmark: paged attention, reference vs fast CPU path (not a test).

Default case: 64 decode sequences of context 384, kv heads 2, heads 8, head_dim 64,
block 16, float32. Also times a mixed batch (the decodes + one 512-token prefill chunk
with a 256-token cached prefix) and write_kv for the step's tokens. Prints one JSON line.

    python bench/attention_cpu.py [--dtype bfloat16] [--repeats 30] [--threads 1]

Timings are the best of ``--repeats`` wall-clock runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from tandem.kernels.kv_write import write_kv
from tandem.kernels.paged_attention import paged_attention, paged_attention_reference
from tandem.kernels.testing import PagedBatch, make_paged_batch


def _time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def _attn(fn: Callable[..., torch.Tensor], b: PagedBatch) -> Callable[[], object]:
    args = (b.query, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.query_start_loc)
    return lambda: fn(*args, b.query.shape[-1] ** -0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=384)
    a = parser.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)

    def batch(ctx: list[int], q_lens: list[int]) -> PagedBatch:
        return make_paged_batch(
            ctx, q_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype
        )

    decode = batch([a.context] * a.seqs, [1] * a.seqs)
    mixed = batch([a.context] * a.seqs + [768], [1] * a.seqs + [512])
    t = mixed.query.shape[0]
    k_new = torch.randn(t, 2, 64).to(dtype)
    slots = torch.randperm(mixed.pool.num_slots)[:t]
    result = {
        "bench": "attention_cpu",
        "dtype": a.dtype,
        "threads": torch.get_num_threads(),
        "decode_seqs": a.seqs,
        "context": a.context,
        "decode_reference_ms": _time_ms(_attn(paged_attention_reference, decode), a.repeats),
        "decode_fast_ms": _time_ms(_attn(paged_attention, decode), a.repeats),
        "mixed_reference_ms": _time_ms(_attn(paged_attention_reference, mixed), a.repeats),
        "mixed_fast_ms": _time_ms(_attn(paged_attention, mixed), a.repeats),
        "write_kv_mixed_ms": _time_ms(
            lambda: write_kv(mixed.k_cache, mixed.v_cache, k_new, k_new, slots), a.repeats
        ),
    }
    result["decode_speedup"] = round(result["decode_reference_ms"] / result["decode_fast_ms"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
