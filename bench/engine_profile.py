"""Where tandem's time goes on the throughput workload, in four parts (tables go to stderr):

1. per-phase timers (schedule / prepare / model / sample / process / advance) over the full
   workload, with the model time split into prefill steps and decode-only steps by batch size;
2. cProfile and 3. torch.profiler (by op, and by op and input shape), both over every request
   with outputs capped at ``profile_max_out`` (48);
4. torch.profiler over 20 steady decode steps with every request in the batch.

`engine_throughput.py --profile` runs this on its engine after the timed runs. On its own it
prints its own JSON summary as the last stdout line::

    .venv/bin/python bench/engine_profile.py [--dtype float32|bfloat16|both] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    add_common_args,
    dtype_list,
    greedy,
    log,
    make_workload,
    print_summary,
    setup,
    timed,
    wait_for_quiet,
)
from bench.engine_hooks import PhaseTimer, is_steady, phase_timer  # noqa: E402
from bench.throughput import load_tandem  # noqa: E402
from tandem import LLM  # noqa: E402


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


DECODE_BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 48), (49, 64), (65, 256))


def _generate(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> None:
    llm.engine.block_manager.reset_prefix_cache()
    llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)


def profile_phases(
    llm: LLM, prompts: list[list[int]], lengths: list[int], wait_quiet_s: float
) -> dict[str, Any]:
    """Part 1: engine phase totals over the full workload, and model time by step type."""
    log("profile 1/4: engine phases over the full throughput workload")
    wait_for_quiet(wait_quiet_s)
    with phase_timer(llm.engine) as timer, timed() as t:
        _generate(llm, prompts, lengths)
    wall = t.wall_s
    phases = timer.totals
    phases["other (step glue, generate loop)"] = wall - sum(phases.values())
    phases_s = {k: round(v, 3) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}
    pct = {k: round(100 * v / wall, 1) for k, v in phases_s.items()}
    model_steps = _model_step_summary(timer)
    lines = [f"    {k:36s} {v:8.3f} s  {pct[k]:5.1f}%" for k, v in phases_s.items()]
    log(
        f"phase breakdown (wall {wall:.2f} s, {len(timer.durations['model'])} steps, "
        f"other processes {_round(t.others_cpu)} of the CPUs):\n"
        + "\n".join(lines)
        + "\n    model steps: "
        + json.dumps(model_steps)
    )
    return {
        "wall_s": round(wall, 3),
        "others_cpu": _round(t.others_cpu),
        "phases_s": phases_s,
        "phases_pct": pct,
        "model_steps": model_steps,
    }


def _model_step_summary(timer: PhaseTimer) -> dict[str, Any]:
    """Model time split into steps with prefill tokens and decode-only steps by batch size."""
    rows = list(zip(timer.model_shapes, timer.durations["model"], strict=True))
    prefill = [(s, d) for s, d in rows if s[0] != s[1]]
    decode = [(s[0], d) for s, d in rows if s[0] == s[1]]
    summary: dict[str, Any] = {
        "prefill_steps": len(prefill),
        "prefill_tokens": sum(s[0] for s, _ in prefill),
        "prefill_model_s": round(sum(d for _, d in prefill), 3),
        "decode_steps": len(decode),
        "decode_tokens": sum(b for b, _ in decode),
        "decode_model_s": round(sum(d for _, d in decode), 3),
    }
    if prefill:
        summary["prefill_ms_per_token"] = round(
            1e3 * summary["prefill_model_s"] / max(1, summary["prefill_tokens"]), 3
        )
    buckets: dict[str, Any] = {}
    for lo, hi in DECODE_BUCKETS:
        sel = [(b, d) for b, d in decode if lo <= b <= hi]
        if sel:
            mean_b = statistics.fmean(b for b, _ in sel)
            median_ms = statistics.median(d for _, d in sel) * 1e3
            buckets[f"{lo}-{hi}"] = {
                "steps": len(sel),
                "mean_batch": round(mean_b, 1),
                "median_model_ms": round(median_ms, 2),
                "ms_per_token": round(median_ms / mean_b, 3),
            }
    summary["decode_by_batch"] = buckets
    return summary


def profile_cprofile(
    llm: LLM, prompts: list[list[int]], lengths: list[int], wait_quiet_s: float, top: int = 25
) -> list[str]:
    """Part 2: cProfile; returns the top 15 functions by own time."""
    log(f"profile 2/4: cProfile over {len(prompts)} requests, outputs capped at {max(lengths)}")
    wait_for_quiet(wait_quiet_s)
    prof = cProfile.Profile()
    prof.enable()
    _generate(llm, prompts, lengths)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    log("cProfile, top by tottime:\n" + buf.getvalue())
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]  # type: ignore[attr-defined]
    return [
        f"{func} ({filename}:{line}) calls={nc} tottime={tt:.3f}s cumtime={ct:.3f}s"
        for (filename, line, func), (_cc, nc, tt, ct, _callers) in entries
    ]


def profile_torch_ops(
    llm: LLM, prompts: list[list[int]], lengths: list[int], wait_quiet_s: float, top: int = 25
) -> list[dict[str, Any]]:
    """Part 3: torch.profiler by op (and by op and input shape, logged); returns the top 15."""
    from torch.profiler import ProfilerActivity, profile

    log(f"profile 3/4: torch.profiler over the same {len(prompts)} requests")
    wait_for_quiet(wait_quiet_s)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as tp:
        _generate(llm, prompts, lengths)
    averages = tp.key_averages()
    log(
        "torch.profiler, by self CPU time:\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=top)
    )
    by_shape = tp.key_averages(group_by_input_shape=True)
    log(
        "torch.profiler, by input shape:\n"
        + by_shape.table(sort_by="self_cpu_time_total", row_limit=top)
    )
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    return [
        {
            "op": e.key,
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1),
            "pct": round(100 * e.self_cpu_time_total / total, 1),
            "calls": e.count,
        }
        for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:15]
    ]


def profile_decode_steps(
    llm: LLM,
    prompts: list[list[int]],
    wait_quiet_s: float,
    *,
    warm_steps: int = 60,
    steps: int = 20,
    top: int = 16,
) -> dict[str, Any]:
    """Part 4: torch.profiler over `steps` steady decode steps with every prompt in the batch
    (after `warm_steps` steps: the prefill plus some decode). Returns the step wall time under
    the profiler and the top ops, in ms per step, by op and by op and input shape."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    n = len(prompts)
    reqs = [engine.add_request(p, greedy(warm_steps + steps + 100)) for p in prompts]
    for _ in range(warm_steps):
        engine.step()
    if not is_steady(engine, n):
        raise RuntimeError("decode profile: the batch is not in steady decode yet")
    ctx = statistics.fmean(r.num_tokens for r in reqs)
    log(f"profile 4/4: torch.profiler over {steps} decode steps, batch {n}, mean context {ctx:.0f}")
    wait_for_quiet(wait_quiet_s)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as tp, timed() as t:
        for _ in range(steps):  # timed inside: the profiler's own start and stop take ~1 s
            engine.step()
    wall_ms = t.wall_s * 1e3 / steps
    for r in reqs:
        engine.abort(r.request_id)
    total = sum(e.self_cpu_time_total for e in tp.key_averages()) or 1.0

    def row(e: Any, with_shapes: bool) -> dict[str, Any]:
        r = {
            "op": e.key,
            "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2),
            "pct": round(100 * e.self_cpu_time_total / total, 1),
            "calls_per_step": round(e.count / steps, 1),
        }
        return {**r, "shapes": str(e.input_shapes)[:100]} if with_shapes else r

    def top_of(events: Any, n: int, with_shapes: bool) -> list[dict[str, Any]]:
        return [
            row(e, with_shapes) for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:n]
        ]

    by_shape = top_of(tp.key_averages(group_by_input_shape=True), top, True)
    by_op = top_of(tp.key_averages(), 10, False)
    fmt = "    {op:50s} {ms_per_step:7.2f} ms/step {pct:5.1f}%  x{calls_per_step:<5} {shapes}"
    log(
        f"decode step (batch {n}, context ~{ctx:.0f}): {wall_ms:.1f} ms/step under the profiler "
        f"(other processes {_round(t.others_cpu)} of the CPUs); "
        "by op and shape:\n"
        + "\n".join(fmt.format(**r) for r in by_shape)
        + "\n  by op:\n"
        + "\n".join(fmt.format(**r, shapes="") for r in by_op)
    )
    return {
        "batch": n,
        "mean_context": round(ctx, 1),
        "wall_ms_per_step": round(wall_ms, 2),
        "others_cpu": _round(t.others_cpu),
        "by_op": by_op,
        "by_op_and_shape": by_shape,
    }


def profile_tandem(
    llm: LLM, prompts: list[list[int]], lengths: list[int], max_out: int, wait_quiet_s: float
) -> dict[str, Any]:
    """All four parts; parts 2 and 3 run every request (so decode batches are as wide as in the
    timed run) with outputs capped at `max_out`."""
    capped = [min(n, max_out) for n in lengths]
    return {
        **profile_phases(llm, prompts, lengths, wait_quiet_s),
        "cprofile_top": profile_cprofile(llm, prompts, capped, wait_quiet_s),
        "torch_ops_top": profile_torch_ops(llm, prompts, capped, wait_quiet_s),
        "decode_step": profile_decode_steps(llm, prompts, wait_quiet_s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Prints progress to stderr and a one-line JSON summary as the last stdout line.",
    )
    add_common_args(parser)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="float32")
    args = parser.parse_args(argv)
    s = setup("engine_profile", args)
    prompts, lengths = make_workload(s.work, s.shape.vocab)
    s.summary["profile"] = {}
    for dtype in dtype_list(args.dtype):
        log(f"tandem ({dtype}): loading")
        llm = load_tandem(s.model_dir, dtype, s.shape)
        s.summary["profile"][dtype] = profile_tandem(
            llm, prompts, lengths, s.work.profile_max_out, args.wait_quiet
        )
        del llm
        gc.collect()
    print_summary(s)


if __name__ == "__main__":
    main()
