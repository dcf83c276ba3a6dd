"""Offline throughput: tandem `LLM.generate` (continuous batching) against transformers
`generate` with static batches, in one dtype, plus the greedy-token spot check between them.

tandem's tok/s counts the tokens it generated. HF's counts the useful tokens: each static batch
runs to the longest of its requests, but only the requested lengths count.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import ModelShape, greedy, log, timed, wait_for_quiet
from bench.engine_hooks import count_steps
from tandem import LLM

# fp32 greedy must be token-exact; bf16 rounds differently in the two implementations, so a
# near-tie can flip a token and the sequence diverges from there.
BF16_MIN_MATCH = 0.9
# Other processes' share of all CPUs during a timed run above which the run is contended.
CONTENDED = 0.05


@dataclass
class GenRun:
    """One timed generation run over the whole workload."""

    tok_s: float
    tokens: int  # tandem: generated; HF: useful (the requested lengths)
    wall_s: float
    cpu_share: float
    others_cpu: float | None  # see `Timing`
    first_batch: list[list[int]]  # greedy tokens of the first HF batch's requests
    extra: dict[str, int] = field(default_factory=dict)


def load_tandem(model_dir: Path, dtype: str, shape: ModelShape) -> LLM:
    """The engine as the throughput run uses it, after a small warm-up generate."""
    llm = LLM(model=str(model_dir), dtype=dtype, max_num_seqs=256, max_num_batched_tokens=2048)
    rng = random.Random(3)
    llm.generate(
        [[rng.randrange(3, shape.vocab) for _ in range(32)] for _ in range(4)],
        greedy(8),
        use_tqdm=False,
    )
    return llm


def run_tandem(llm: LLM, prompts: list[list[int]], lengths: list[int], first_batch: int) -> GenRun:
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()  # repeats must not hit the previous run's prompts
    gc.collect()
    with count_steps(engine) as steps, timed() as t:
        outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    generated = sum(len(o.token_ids) for o in outs)
    return GenRun(
        tok_s=generated / t.wall_s,
        tokens=generated,
        wall_s=t.wall_s,
        cpu_share=t.cpu_share,
        others_cpu=t.others_cpu,
        first_batch=[list(o.token_ids) for o in outs[:first_batch]],
        extra={
            "steps": steps[0],
            "prefix_cache_hit_tokens": sum(o.num_cached_tokens for o in outs),
        },
    )


def load_hf(model_dir: Path, dtype: str) -> Any:
    """transformers' model in `dtype`, set up for greedy decoding with no EOS, then warmed up."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=getattr(torch, dtype)
    )
    model.eval()
    cfg = model.generation_config
    cfg.eos_token_id = None
    cfg.pad_token_id = 0
    cfg.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(cfg, name):
            setattr(cfg, name, None)
    hf_generate(model, [[3, 4, 5, 6]] * 2, 4)
    return model


def hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """The new tokens of one static batch (equal-length prompts, so no padding)."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
        )
    assert out.shape == (len(prompts), ids.shape[1] + max_new_tokens), out.shape
    return out[:, ids.shape[1] :]


def run_hf(model: Any, prompts: list[list[int]], lengths: list[int], batch: int) -> GenRun:
    useful = computed = 0
    first: list[list[int]] = []
    num_batches = math.ceil(len(prompts) / batch)
    gc.collect()
    with timed() as t:
        for b in range(0, len(prompts), batch):
            batch_lens = lengths[b : b + batch]
            new = hf_generate(model, prompts[b : b + batch], max(batch_lens))
            useful += sum(batch_lens)
            computed += max(batch_lens) * len(batch_lens)
            if b == 0:
                first = [new[i, :n].tolist() for i, n in enumerate(batch_lens)]
            log(f"  hf batch {b // batch + 1}/{num_batches} done")
    return GenRun(
        tok_s=useful / t.wall_s,
        tokens=useful,
        wall_s=t.wall_s,
        cpu_share=t.cpu_share,
        others_cpu=t.others_cpu,
        first_batch=first,
        extra={"computed_tokens": computed},
    )


def best_of(
    label: str, repeats: int, wait_quiet_s: float, run: Callable[[], GenRun]
) -> tuple[GenRun, dict[str, Any]]:
    """`repeats` timed runs, each after waiting for quiet CPUs; returns the best (highest tok/s)
    and its summary entry, which lists every run's tok/s and CPU accounting.

    When waiting is on (`wait_quiet_s` > 0), a run during which other processes took more than
    `CONTENDED` of the CPUs does not count towards `repeats`: up to `repeats` of them are run
    again. They stay in the lists, and can still be the best."""
    runs: list[GenRun] = []
    clean = 0
    max_runs = 2 * repeats if wait_quiet_s > 0 else repeats
    while clean < repeats and len(runs) < max_runs:
        log(f"{label}: run {len(runs) + 1} ({clean} clean of {repeats})")
        wait_for_quiet(wait_quiet_s)
        r = run()
        runs.append(r)
        contended = r.others_cpu is not None and r.others_cpu > CONTENDED
        clean += not contended
        log(
            f"{label}: {r.tokens} tokens in {r.wall_s:.2f} s = {r.tok_s:.1f} tok/s {r.extra} "
            f"(cpu share {r.cpu_share:.2f}, other processes {_pct(r.others_cpu)} of the CPUs"
            f"{': contended' if contended else ''})"
        )
    best = max(runs, key=lambda r: r.tok_s)
    entry = {
        "tok_s": round(best.tok_s, 1),
        "tokens": best.tokens,
        "wall_s": round(best.wall_s, 3),
        **best.extra,
        "all_tok_s": [round(r.tok_s, 1) for r in runs],
        "clean_runs": clean,
        "cpu_share": [round(r.cpu_share, 2) for r in runs],
        "others_cpu": [None if r.others_cpu is None else round(r.others_cpu, 3) for r in runs],
    }
    return best, entry


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def match_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of `b`'s tokens that `a` has at the same position of the same request."""
    total = sum(len(y) for y in b)
    equal = sum(sum(s == t for s, t in zip(x, y, strict=False)) for x, y in zip(a, b, strict=True))
    return equal / total if total else 1.0


def first_diff(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next(
        (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def divergence_gap_ulps(
    model: Any, prompt: list[int], hf_tokens: list[int], j: int, other: int
) -> float:
    """How far HF's own choice at position `j` is ahead of `other` (tandem's token), in units in
    the last place of the model's dtype at that logit's magnitude. HF re-runs the prompt plus
    its first `j` tokens in one forward pass (no KV cache), so a gap of 0 or below means HF's
    teacher-forced forward agrees with tandem, or ties."""
    ids = torch.tensor([prompt + hf_tokens[:j]], dtype=torch.int64)
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()
    ours = logits[hf_tokens[j]].item()
    ulp = torch.finfo(model.dtype).eps * 2.0 ** math.floor(math.log2(abs(ours) or 1.0))
    return (ours - logits[other].item()) / ulp


def spot_check(
    dtype: str,
    tandem_first: list[list[int]],
    hf_first: list[list[int]],
    hf_model: Any,
    prompts: list[list[int]],
) -> dict[str, Any]:
    """tandem's greedy tokens against HF's for the first HF batch, each truncated to its
    request's length. float32 passes when every request matches exactly; bfloat16 when at least
    `BF16_MIN_MATCH` of the tokens are equal position by position.

    For every request that differs, the first differing position and HF's logit gap there (see
    `divergence_gap_ulps`): a gap of about one ulp or less says the tokens split at a near-tie,
    after which greedy decoding follows a different path."""
    mismatches = []
    for i, (a, b) in enumerate(zip(tandem_first, hf_first, strict=True)):
        j = first_diff(a, b)
        if j is None:
            continue
        row: dict[str, Any] = {"request": i, "first_diff_at": j, "len": len(b)}
        if j < min(len(a), len(b)):
            gap = divergence_gap_ulps(hf_model, prompts[i], b, j, a[j])
            row["hf_gap_ulps"] = round(gap, 2)
        mismatches.append(row)
    fraction = match_fraction(tandem_first, hf_first)
    exact = dtype == "float32"
    gaps = [m["hf_gap_ulps"] for m in mismatches if "hf_gap_ulps" in m]
    return {
        "requests_checked": len(hf_first),
        "tokens_checked": sum(len(b) for b in hf_first),
        "mismatched_requests": len(mismatches),
        "token_match_fraction": round(fraction, 4),
        "criterion": "exact" if exact else f"token_match_fraction >= {BF16_MIN_MATCH}",
        "passed": not mismatches if exact else fraction >= BF16_MIN_MATCH,
        "max_divergence_gap_ulps": max(gaps) if gaps else None,
        "mismatches": mismatches,
    }
