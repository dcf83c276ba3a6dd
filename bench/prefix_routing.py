"""Prefix-routing benchmark (issue 5): prefix hit rate and balance per policy, decision speed.

1. Shared-prefix workload on simulated prefill workers (`bench/prefix_routing_sim.py`: real block
   managers and the engine's scheduler, no model): 32 groups x 16 prompts, a 1,024-token system
   prompt per group, a 64-token question, 64 output tokens; 4 prefill workers, each with KV blocks
   for a third of the prefix working set. Token-weighted prefix hit rate of round-robin,
   least-loaded, power-of-two and cache affinity against the ideal (15/16 * 1024/1088 = 0.882),
   and max/min requests per worker (targets for affinity: >= 95 % of ideal, max/min <= 1.2).
   Cache affinity runs twice: on the exact index alone, and with the `PendingPrefixes` overlay
   ("routed, not yet published": each routed chain recorded on its worker for
   `--pending-ttl-steps` scheduler steps, matched next to the index). Then cache affinity over
   arrival rates and seeds, with and without the overlay, to show how much the figures move.
2. Router decisions per second on one thread with 4 and 64 workers, and the p99 latency of one
   decision (index match + overlay match + policy choice + overlay record); targets >= 100,000/s
   and <= 100 us. The index-only figures are printed next to them.

Usage: python bench/prefix_routing.py [--quick]. Tables on stderr; a JSON summary is the last
line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prefix_routing_decisions import measure_decisions  # noqa: E402
from bench.prefix_routing_sim import Workload, simulate  # noqa: E402

POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_affinity")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _row(label: str, r: dict[str, Any]) -> str:
    return (
        f"{label:<24}{r['hit_rate']:>10.4f}{r['of_ideal']:>10.3f}{r['max_min']:>9.3f}  "
        f"{r['requests_per_worker']}"
    )


def run_policies(w: Workload, ttl: float) -> list[dict[str, Any]]:
    log(f"\n## hit rate and balance (rate {w.rate}/step, order {w.order}, seed {w.seed})")
    log(f"blocks per worker {w.blocks_per_worker}, ideal hit rate {w.ideal_hit_rate:.4f}")
    log(f"{'policy':<24}{'hit rate':>10}{'of ideal':>10}{'max/min':>9}  requests per worker")
    rows = []
    for policy in POLICIES:
        r = simulate(policy, w)
        rows.append(r)
        log(_row(policy, r))
    r = simulate("cache_affinity", w, pending_ttl_steps=ttl)
    rows.append(r)
    log(_row(f"cache_affinity+pending{ttl:g}", r))
    return rows


def run_sweep(
    w: Workload, rates: list[float], seeds: list[int], ttl: float | None
) -> list[dict[str, Any]]:
    overlay = "without overlay" if ttl is None else f"with overlay (TTL {ttl:g} steps)"
    log(f"\n## cache affinity over arrival rates and seeds, {overlay} (of ideal / max-min)")
    log(f"{'rate':>6}  " + "  ".join(f"{'seed ' + str(s):>13}" for s in seeds))
    rows = []
    for rate in rates:
        cells = []
        for seed in seeds:
            r = simulate("cache_affinity", replace(w, rate=rate, seed=seed), pending_ttl_steps=ttl)
            rows.append({"rate": rate, "seed": seed, **r})
            cells.append(f"{r['of_ideal']:.3f} / {r['max_min']:.2f}")
        log(f"{rate:>6g}  " + "  ".join(f"{c:>13}" for c in cells))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer decisions, no sweep")
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per scheduler step")
    parser.add_argument("--order", choices=("shuffle", "interleave"), default="shuffle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decisions", type=int, default=200_000, help="per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--pending-ttl-steps", type=float, default=2.0, help="overlay TTL, in scheduler steps"
    )
    args = parser.parse_args()
    load = os.getloadavg()
    log(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    w = Workload(rate=args.rate, order=args.order, seed=args.seed)
    t0 = time.perf_counter()
    ttl = args.pending_ttl_steps
    policies = run_policies(w, ttl)
    rates, seeds = [1.0, 2.0, 4.0, 8.0, 16.0], [0, 1, 2]
    sweep = [] if args.quick else run_sweep(w, rates, seeds, ttl)
    sweep_without = [] if args.quick else run_sweep(w, rates, seeds, None)
    log(f"(simulation {time.perf_counter() - t0:.1f} s)")
    n = 20_000 if args.quick else args.decisions
    repeats = 1 if args.quick else args.repeats
    decisions = [measure_decisions(workers, n, repeats, log) for workers in (4, 64)]
    without = [measure_decisions(workers, n, repeats, log, overlay=False) for workers in (4, 64)]
    # targets on the router's default configuration (no overlay: `routing.pending_ttl_s = 0`);
    # the overlay's figures are reported next to them
    default = next(
        p for p in policies if p["policy"] == "cache_affinity" and not p["pending_ttl_steps"]
    )
    overlay = policies[-1]
    summary = {
        "bench": "prefix_routing",
        "workload": asdict(w),
        "ideal_hit_rate": round(w.ideal_hit_rate, 4),
        "policies": policies,
        "pending_ttl_steps": ttl,
        "affinity_sweep": sweep,
        "affinity_sweep_without_overlay": sweep_without,
        "decisions": decisions,
        "decisions_without_overlay": without,
        "targets_met": {
            "affinity_of_ideal_ge_0.95": default["of_ideal"] >= 0.95,
            "affinity_max_min_le_1.2": default["max_min"] <= 1.2,
            "decisions_per_s_ge_100k": all(d["decisions_per_s"] >= 100_000 for d in without),
            "p99_le_100us": all(d["p99_us"] <= 100 for d in without),
        },
        "with_overlay": {
            "of_ideal": overlay["of_ideal"],
            "max_min": overlay["max_min"],
            "sweep_cells_of_ideal_ge_0.95": sum(r["of_ideal"] >= 0.95 for r in sweep),
            "sweep_cells_without_overlay_of_ideal_ge_0.95": sum(
                r["of_ideal"] >= 0.95 for r in sweep_without
            ),
            "decisions_per_s": [d["decisions_per_s"] for d in decisions],
            "p99_us": [d["p99_us"] for d in decisions],
        },
        "load_average": [round(x, 2) for x in load],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
