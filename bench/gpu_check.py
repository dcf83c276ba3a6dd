"""GPU check: exactness against Hugging Face on the GPU, decode-kernel bandwidth, engine tok/s.

Not a test. Needs a CUDA GPU and ``triton`` (``pip install -e '.[gpu]'``); without a GPU it says
so and exits 0. Three parts, each printed to stderr as it runs; the last stdout line is a JSON
summary:

1. **Exactness** (float32 and bfloat16): a tiny random Llama checkpoint (GQA 4:2) on ``cuda``,
   16 prompts x 32 greedy tokens, tandem (``device="cuda"``, Triton kernels, chunked prefill)
   against ``transformers`` ``generate`` on the same GPU. float32 must be token-exact; bfloat16
   must match at least 90 % of the tokens position by position (both sides round differently),
   or else diverge only at rounding ties: at each prompt's first differing token the float32
   model's margin between the two picks is under 2 % of the logits' standard deviation (the
   summary lists every divergence with Hugging Face's margin and the float32 model's choice).
2. **Decode kernel bandwidth**: the Triton decode kernel (split-K) on a bfloat16 pool with
   8 KV heads x 128 dims, 32 query heads, block size 16, at long contexts; achieved bandwidth =
   bytes of K, V and queries read / time per call (CUDA events around 10 back-to-back calls, so
   that the Python launch overlaps the previous call; median of 20), against a device-to-device
   copy of 2 GiB measured in the same run (read + written bytes / time). Also one call alone
   (launch included) and a sweep of the split count (decode programs per SM: 2, 4, 8, 16).
   Target: >= 70 % of copy bandwidth at long contexts.
3. **Engine decode tok/s** at batch 1, 16 and 64: a random ~0.1B Llama (8 layers, hidden 1024,
   bfloat16) on ``cuda``, 128-token prompts, 128 greedy tokens each; decode time only (the clock
   starts once every request has its first token).

    .venv/bin/python bench/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import DEFAULT_CACHE, ModelShape, ensure_checkpoint, log  # noqa: E402

BANDWIDTH_TARGET = 0.70
TIE_FRACTION = 0.02
"""bfloat16 passes below 90 % token match when every first divergence is a rounding tie: the
float32 model's margin between the two picks is under this fraction of the logits' spread."""
EXACT_SHAPE = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, intermediate=256)
DECODE_SHAPE = ModelShape(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816)


def _cuda_time_ms(
    fn: Callable[[], Any], repeats: int = 20, warmup: int = 3, calls: int = 1
) -> float:
    """Median milliseconds per call of ``fn`` on the current stream (CUDA events around
    ``calls`` back-to-back calls, so that with ``calls`` > 1 the launch overhead overlaps)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


# ---- 1. exactness ------------------------------------------------------------------------------
def check_exactness(dtype: str, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from tandem import LLM, SamplingParams

    path = ensure_checkpoint(DEFAULT_CACHE, EXACT_SHAPE)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 200, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, EXACT_SHAPE.vocab, (n,), generator=gen).tolist() for n in lengths]
    hf: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    hf = hf.to("cuda").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ref = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_tokens)  # fmt: skip
            ref.append(out[0, len(prompt) :].tolist())
    llm = LLM(model=str(path), dtype=dtype, device="cuda", num_kv_blocks=2048,
              max_num_batched_tokens=256)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True), use_tqdm=False)  # fmt: skip
    same = sum(a == b for o, r in zip(outs, ref, strict=True)
               for a, b in zip(o.token_ids, r, strict=True))  # fmt: skip
    total = num_prompts * max_tokens
    exact_prompts = sum(o.token_ids == r for o, r in zip(outs, ref, strict=True))
    result = {
        "dtype": dtype,
        "tokens_equal": same,
        "tokens": total,
        "token_match": round(same / total, 4),
        "prompts_exact": exact_prompts,
        "prompts": num_prompts,
    }
    if same != total:
        result["divergences"] = explain_divergences(path, hf, prompts, ref, outs)
    ties = all(d["fp32_margin"] < TIE_FRACTION * d["logit_std"]
               for d in result.get("divergences", []))  # fmt: skip
    result["ok"] = same == total if dtype == "float32" else same / total >= 0.9 or ties
    del hf
    log(f"exactness {dtype}: {same}/{total} tokens equal, {exact_prompts}/{num_prompts} prompts")
    return result


def explain_divergences(
    path: Path, hf: Any, prompts: list[list[int]], ref: list[list[int]], outs: list[Any]
) -> list[dict[str, Any]]:
    """At each prompt's first differing token: Hugging Face's own margin between its pick and
    tandem's (logits of the same model and dtype, one forward over prompt + agreed tokens), and
    which pick a float32 copy of the model prefers. A near-zero margin means a rounding tie."""
    from transformers import AutoModelForCausalLM

    fp32: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    fp32 = fp32.to("cuda").eval()
    rows = []
    with torch.inference_mode():
        for prompt, want, out in zip(prompts, ref, outs, strict=True):
            got = list(out.token_ids)
            if got == want:
                continue
            at = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            ids = torch.tensor([prompt + want[:at]], device="cuda")
            low = hf(ids).logits[0, -1].float()
            high = fp32(ids).logits[0, -1]
            rows.append({
                "position": at,
                "hf_margin": round(float(low[want[at]] - low[got[at]]), 4),
                "logit_std": round(float(low.std()), 4),
                "fp32_prefers": "hf" if high[want[at]] > high[got[at]] else "tandem",
                "fp32_margin": round(abs(float(high[want[at]] - high[got[at]])), 5),
            })  # fmt: skip
    for row in rows:
        log(f"  diverged at token {row['position']}: HF margin {row['hf_margin']} "
            f"(logit std {row['logit_std']}), float32 prefers {row['fp32_prefers']} "
            f"by {row['fp32_margin']}")  # fmt: skip
    return rows


# ---- 2. decode kernel bandwidth ------------------------------------------------------------------
def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _cuda_time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3) / 1e9


SPLIT_SWEEP = (2, 4, 8, 16)
"""Decode programs per SM tried for every shape (the kernel's default is marked)."""


def decode_bandwidth(batch: int, context: int, quick: bool) -> dict[str, Any]:
    from tandem.kernels.kv_cache import KVCachePool
    from tandem.kernels.triton_attention import (
        DECODE_PROGRAMS_PER_SM,
        _num_splits,
        paged_attention_triton,
    )

    kv_heads, heads, head_dim, block = 8, 32, 128, 16
    blocks_per_seq = -(-context // block)
    pool = KVCachePool(batch * blocks_per_seq + 1, 1, block, kv_heads, head_dim,
                       dtype=torch.bfloat16, device="cuda")  # fmt: skip
    pool.tensor.normal_()
    k_cache, v_cache = pool.layer_cache(0)
    order = torch.randperm(batch * blocks_per_seq, device="cuda")  # scattered blocks
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    read = batch * context * kv_heads * head_dim * 2 * 2 + query.numel() * 2
    repeats = 5 if quick else 20

    def timed(splits: int, calls: int) -> float:
        def run() -> None:
            paged_attention_triton(query, k_cache, v_cache, tables, ctx, qsl, head_dim**-0.5,
                                   max_query_len=1, max_context_len=context,
                                   num_splits=splits)  # fmt: skip

        return _cuda_time_ms(run, repeats=repeats, calls=calls)

    sweep = {}
    for per_sm in SPLIT_SWEEP:
        splits = _num_splits(batch, kv_heads, context, query.device, per_sm)
        ms = timed(splits, 10)
        sweep[str(per_sm)] = {"splits": splits, "gb_per_s": round(read / (ms / 1e3) / 1e9, 1)}
    default = _num_splits(batch, kv_heads, context, query.device)
    ms = timed(default, 10)
    single = timed(default, 1)
    return {"batch": batch, "context": context, "splits": default, "ms": round(ms, 4),
            "gb_per_s": round(read / (ms / 1e3) / 1e9, 1),
            "single_call_ms": round(single, 4),
            "per_sm_sweep": sweep, "default_per_sm": DECODE_PROGRAMS_PER_SM}  # fmt: skip


def kernel_bandwidth(quick: bool) -> dict[str, Any]:
    """Part 2 for every shape, against the copy bandwidth; the summary's kernel entries."""
    copy_gbs = copy_bandwidth_gbs()
    log(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    shapes = [(1, 32768), (16, 8192), (64, 4096)] if quick else [
        (1, 4096), (1, 32768), (1, 131072), (16, 8192), (16, 32768), (64, 4096), (64, 16384),
    ]  # fmt: skip
    kernel = []
    for batch, context in shapes:
        row = decode_bandwidth(batch, context, quick)
        row["of_copy"] = round(row["gb_per_s"] / copy_gbs, 3)
        log(f"decode kernel batch {batch} ctx {context}: {row['gb_per_s']} GB/s "
            f"= {row['of_copy']:.0%} of copy ({row['splits']} splits; one call alone "
            f"{row['single_call_ms']} ms; per-SM sweep {row['per_sm_sweep']})")  # fmt: skip
        kernel.append(row)
    long_ctx = [r["of_copy"] for r in kernel if r["batch"] * r["context"] >= 131072]
    return {
        "copy_gb_per_s": round(copy_gbs, 1),
        "decode_kernel": kernel,
        "decode_kernel_long_context_of_copy": min(long_ctx) if long_ctx else None,
        "decode_kernel_target_met": bool(long_ctx) and min(long_ctx) >= BANDWIDTH_TARGET,
    }


# ---- 3. engine decode tokens/s -------------------------------------------------------------------
def engine_decode_tps(batch: int, prompt_len: int, out_len: int) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    path = ensure_checkpoint(DEFAULT_CACHE, DECODE_SHAPE)
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", num_kv_blocks=4096,
              max_num_batched_tokens=8192)  # fmt: skip
    engine = llm.engine
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, DECODE_SHAPE.vocab, (prompt_len,), generator=gen)
                           .tolist(), params)  # fmt: skip
    started: set[str] = set()
    while len(started) < batch:  # prefill (and the first token of every request)
        started.update(o.request_id for o in engine.step())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    log(f"engine decode batch {batch}: {tokens} tokens in {seconds:.2f}s")
    return {"batch": batch, "decode_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument(
        "--parts",
        default="exactness,kernel,engine",
        help="comma-separated subset of exactness, kernel, engine (default: all three)",
    )
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if unknown := parts - {"exactness", "kernel", "engine"}:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        print("[gpu_check] no CUDA GPU on this machine: nothing to check", file=sys.stderr)
        print(json.dumps({"gpu": None, "skipped": "no CUDA GPU"}))
        return
    summary: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    summary["triton"] = triton.__version__
    if "exactness" in parts:
        summary["exactness"] = [check_exactness(d, 8 if args.quick else 16, 32)
                                for d in ("float32", "bfloat16")]  # fmt: skip
    if "kernel" in parts:
        summary.update(kernel_bandwidth(args.quick))
    if "engine" in parts:
        summary["engine_decode"] = [engine_decode_tps(b, 128, 64 if args.quick else 128)
                                    for b in (1, 16, 64)]  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
