"""End-to-end benchmark: tandem offline throughput vs Hugging Face `generate`, and host overhead.

Not a test. Runs on CPU with a ~40M-parameter random Llama checkpoint that it builds (once) under
``.tandem/bench-models/``. For each ``--dtype`` (float32, bfloat16, or both, the default):

1. Throughput (`throughput.py`): 64 requests, 128-token random prompts, output lengths uniform
   in [16, 256], greedy, ``ignore_eos``. tandem (``LLM.generate``, continuous batching) against
   transformers ``generate`` with static batches of 8, both in that dtype. The ratio target is
   4. Spot check on the first HF batch: float32 must be token-exact; bfloat16 must have at least
   90% of the tokens equal position by position.
2. ``--profile`` (`engine_profile.py`): where tandem's time goes, printed to stderr.

Then host overhead once (`host_overhead.py`): a no-op model, N requests in steady decode,
microseconds per ``engine.step()`` against ``200 + 5 * N``.

Progress goes to stderr; the last stdout line is a JSON summary. Run from the repository root:

    .venv/bin/python bench/engine_throughput.py [--dtype both] [--quick] [--profile] [--repeats N]
        [--skip-tandem] [--skip-hf] [--skip-overhead] [--wait-quiet SECONDS]
    .venv/bin/python -m bench.engine_throughput ...   (the same)
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    Setup,
    add_common_args,
    dtype_list,
    log,
    make_workload,
    print_summary,
    setup,
)
from bench.engine_profile import profile_tandem  # noqa: E402
from bench.host_overhead import measure as measure_host_overhead  # noqa: E402
from bench.throughput import (  # noqa: E402
    GenRun,
    best_of,
    load_hf,
    load_tandem,
    match_fraction,
    run_hf,
    run_tandem,
    spot_check,
)

RATIO_TARGET = 4.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Prints progress to stderr and a one-line JSON summary as the last stdout line.",
    )
    add_common_args(parser)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "both"),
        default="both",
        help="dtype of both tandem and HF (default: both, float32 first)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs of tandem and of HF each, per dtype; the best (highest tok/s) counts. "
        "With --wait-quiet on, runs that other processes slowed are redone (at most N more)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile tandem (phases, cProfile, torch)"
    )
    parser.add_argument(
        "--skip-tandem",
        action="store_true",
        help="skip the timed tandem runs (no ratio / spot check; --profile still runs)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument(
        "--skip-overhead", action="store_true", help="skip the no-op-model host overhead part"
    )
    parser.add_argument(
        "--overhead-threads",
        type=int,
        default=None,
        help="torch threads for the host-overhead part (default: --threads)",
    )
    return parser.parse_args(argv)


def run_dtype(
    s: Setup, args: argparse.Namespace, dtype: str, prompts: list[list[int]], lengths: list[int]
) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    """Throughput of tandem and HF in `dtype` (and the profile). Returns the summary entry and
    the greedy tokens of the first HF batch, by engine ("tandem", "hf"), for what ran."""
    entry: dict[str, Any] = {}
    firsts: dict[str, list[list[int]]] = {}
    batch = s.work.hf_batch
    tandem_best: GenRun | None = None
    if not args.skip_tandem or args.profile:
        log(f"tandem ({dtype}): loading")
        llm = load_tandem(s.model_dir, dtype, s.shape)
        if not args.skip_tandem:
            tandem_best, entry["tandem"] = best_of(
                f"tandem ({dtype}), {len(prompts)} requests",
                args.repeats,
                args.wait_quiet,
                lambda: run_tandem(llm, prompts, lengths, batch),
            )
            firsts["tandem"] = tandem_best.first_batch
            if tandem_best.tokens != sum(lengths):
                log(f"WARNING: tandem generated {tandem_best.tokens} tokens, not {sum(lengths)}")
        if args.profile:
            entry["profile"] = profile_tandem(
                llm, prompts, lengths, s.work.profile_max_out, args.wait_quiet
            )
        del llm
        gc.collect()

    if not args.skip_hf:
        log(f"hf ({dtype}): loading")
        model = load_hf(s.model_dir, dtype)
        hf_best, entry["hf"] = best_of(
            f"hf ({dtype}), static batches of {batch}",
            args.repeats,
            args.wait_quiet,
            lambda: run_hf(model, prompts, lengths, batch),
        )
        firsts["hf"] = hf_best.first_batch
        if tandem_best is not None:
            ratio = tandem_best.tok_s / hf_best.tok_s
            entry["ratio"] = round(ratio, 2)
            entry["ratio_met"] = ratio >= RATIO_TARGET
            entry["spot_check"] = spot_check(
                dtype, tandem_best.first_batch, hf_best.first_batch, model, prompts[:batch]
            )
            log(
                f"{dtype}: ratio tandem/hf = {ratio:.2f} (target >= {RATIO_TARGET}); "
                f"spot check {entry['spot_check']}"
            )
        del model
        gc.collect()
    return entry, firsts


def add_vs_float32(
    entries: dict[str, dict[str, Any]], firsts: dict[str, dict[str, list[list[int]]]]
) -> None:
    """When both dtypes ran: how many of each engine's bfloat16 tokens (first HF batch) equal
    its own float32 tokens. It shows how much greedy decoding of this random-weight model moves
    with bf16 rounding alone, whatever the engine."""
    if "float32" not in firsts or "bfloat16" not in firsts:
        return
    entries["bfloat16"]["token_match_vs_float32"] = {
        engine: round(match_fraction(firsts["bfloat16"][engine], firsts["float32"][engine]), 4)
        for engine in ("tandem", "hf")
        if engine in firsts["bfloat16"] and engine in firsts["float32"]
    }


def report(summary: dict[str, Any]) -> None:
    """A human-readable recap of the JSON summary, on stderr."""
    lines = ["summary:"]
    for dtype, e in summary.get("dtypes", {}).items():
        t, h = e.get("tandem", {}).get("tok_s"), e.get("hf", {}).get("tok_s")
        check = e.get("spot_check")
        check_s = (
            f"{check['mismatched_requests']} mismatched requests, "
            f"{check['token_match_fraction']:.1%} tokens equal, "
            f"max gap at divergence {check['max_divergence_gap_ulps']} ulp, "
            f"passed={check['passed']}"
            if check
            else "-"
        )
        lines.append(
            f"  {dtype:9s} tandem {t} tok/s | hf {h} tok/s | ratio {e.get('ratio', '-')} | "
            f"spot check: {check_s}"
        )
        if "token_match_vs_float32" in e:
            lines.append(f"  {dtype:9s} tokens equal to float32: {e['token_match_vs_float32']}")
    overhead = summary.get("host_overhead", {})
    for key in ("vocab", "narrow"):
        for r in overhead.get(key, []):
            lines.append(
                f"  host overhead {key:6s} N={r['n']:4d}: {r['us_per_step_median']:8.1f} us "
                f"(target {r['target_us']}, {'met' if r['met'] else 'missed'})"
            )
    log("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    s = setup("engine_throughput", args)
    prompts, lengths = make_workload(s.work, s.shape.vocab)
    w = s.work
    s.summary["workload"] = {
        "requests": w.num_requests,
        "prompt_len": w.prompt_len,
        "output_len_range": [w.min_out, w.max_out],
        "requested_output_tokens": sum(lengths),
        "hf_batch": w.hf_batch,
        "ratio_target": RATIO_TARGET,
    }
    s.summary["dtypes"] = {}
    firsts: dict[str, dict[str, list[list[int]]]] = {}
    for dtype in dtype_list(args.dtype):
        s.summary["dtypes"][dtype], firsts[dtype] = run_dtype(s, args, dtype, prompts, lengths)
    add_vs_float32(s.summary["dtypes"], firsts)

    if not args.skip_overhead:
        torch.set_num_threads(args.overhead_threads or args.threads)
        s.summary["host_overhead"] = measure_host_overhead(
            s.model_dir, s.shape.vocab, w, args.wait_quiet
        )
        torch.set_num_threads(args.threads)
    report(s.summary)
    print_summary(s)


if __name__ == "__main__":
    main()
