"""Runs the serving scenarios on this machine and writes the figures, plots and docs section.

    .venv/bin/python -m bench.scenarios.run_all            # ~10 min on 2 cores; updates docs/
    .venv/bin/python -m bench.scenarios.run_all --quick --out /tmp/scen   # ~3 min smoke run

1. mixed traffic (`mixed_traffic.py`) and 2. the goodput sweep (`goodput_sweep.py`) share one
local Ray cluster and redeploy tandem per configuration (`settings.py`); 3. decode throughput
(`decode_throughput.py`) runs the engine benchmark after the cluster is gone. Writes
`scenarios.json`, `img/scenarios_latency_cdf.png`, `img/scenarios_goodput.png` under `--out`
and, there, the scenario section of `benchmarks.md` (between its markers).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from tandem.bench.common import DEFAULT_CACHE, ensure_checkpoint, log
from tandem.bench.scenarios import decode_throughput, goodput_sweep, mixed_traffic, plots
from tandem.bench.scenarios.cluster import ScenarioCluster
from tandem.bench.scenarios.report import (
    goodput_table,
    mixed_table,
    replace_section,
    throughput_table,
)
from tandem.bench.scenarios.settings import (
    ENGINE,
    MODEL,
    QUICK_GOODPUT,
    QUICK_MIXED,
    GoodputScenario,
    MixedScenario,
)
from tandem.bench.serving.prompts import TokenPrompts

REPO = Path(__file__).resolve().parents[2]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small smoke settings")
    p.add_argument("--out", type=Path, default=REPO / "docs", help="docs folder to write into")
    p.add_argument("--skip", default="", help="comma-separated: mixed, goodput, throughput")
    p.add_argument(
        "--wait-load",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait (at most this long) for the 1-minute load average to fall below 1.0",
    )
    return p.parse_args()


def wait_for_low_load(max_wait_s: float, threshold: float = 1.0) -> None:
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > threshold and time.monotonic() < deadline:
        log(f"load average {os.getloadavg()[0]:.2f} > {threshold}: waiting")
        time.sleep(30)


def verdicts(results: dict[str, Any]) -> list[str]:
    lines = []
    if "mixed" in results:
        cfg = results["mixed"]["configs"]
        for name in ("colocated, chunked prefill", "1 prefill + 1 decode"):
            if name in cfg:
                ratio = cfg[name]["ttft_p99_ratio"]
                met = "met" if ratio <= 2 else "NOT met"
                lines.append(
                    f"- Short-request TTFT p99 <= 2x no load, {name}: **{met}** ({ratio:.2f}x)."
                )
    if "goodput" in results:
        cfg = results["goodput"]["configs"]
        colo, pd = cfg.get("colocated, chunked prefill"), cfg.get("1 prefill + 1 decode")
        if colo and pd:
            ratio = pd["max_rate"] / colo["max_rate"] if colo["max_rate"] else float("nan")
            met = "met" if ratio >= 2 else "NOT met"  # (nan: colocated never met the SLOs)
            lines.append(
                f"- PD max rate at >= 90% SLO attainment >= 2x colocated: **{met}** "
                f"({pd['max_rate']:.2f} vs {colo['max_rate']:.2f} req/s, {ratio:.2f}x)."
            )
    return lines


def section(results: dict[str, Any], command: str) -> str:
    parts = [
        f"Command: `{command}` ({results['wall_s'] / 60:.1f} min; load average "
        f"{results['load_start'][0]:.2f} at the start, {results['load_end'][0]:.2f} at the end, "
        f"on {os.cpu_count()} cores). Raw figures: `docs/scenarios.json`.",
        "",
        *verdicts(results),
    ]
    if "mixed" in results:
        s = results["mixed"]["settings"]
        parts += [
            "",
            f"**Mixed traffic**: {s['num_prompts']} requests, Poisson at {s['request_rate']:g} "
            f"req/s; no load = {s['no_load_prompts']} short requests one at a time.",
            "",
            mixed_table(results["mixed"]),
            "",
            "![latency CDFs](img/scenarios_latency_cdf.png)",
        ]
    if "goodput" in results:
        s = results["goodput"]["settings"]
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slos_ms"].items())
        parts += [
            "",
            f"**Goodput sweep**: random prompts of {s['input_len']} tokens and outputs of "
            f"{s['output_len']} (+-{s['range_ratio']:.0%}), Poisson arrivals, "
            f"{s['seconds_per_rate']:g} s of arrivals per rate; SLOs {slos}. "
            "Attainment counts every request sent (failed ones miss).",
            "",
            goodput_table(results["goodput"]),
            "",
            "![goodput vs rate](img/scenarios_goodput.png)",
        ]
    if "throughput" in results:
        tp = results["throughput"]
        parts += [
            "",
            f"**Decode throughput** (`{tp['command']}`): {tp['workload']['requests']} requests, "
            f"{tp['workload']['prompt_len']}-token prompts, outputs "
            f"{tp['workload']['output_len_range'][0]}-{tp['workload']['output_len_range'][1]} "
            f"tokens, {tp['model_parameters'] / 1e6:.0f}M-parameter Llama, float32.",
            "",
            throughput_table(tp),
        ]
    return "\n".join(parts)


def main() -> None:
    args = parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    wait_for_low_load(args.wait_load)
    started, load_start = time.monotonic(), os.getloadavg()
    model = ensure_checkpoint(DEFAULT_CACHE, MODEL)
    maker = TokenPrompts.from_pretrained(model)
    mixed_s, goodput_s = (
        (QUICK_MIXED, QUICK_GOODPUT) if args.quick else (MixedScenario(), GoodputScenario())
    )
    results: dict[str, Any] = {"model": str(model.name), "engine": ENGINE, "quick": args.quick}
    if not {"mixed", "goodput"} <= skip:
        with ScenarioCluster(str(model)) as cluster:
            if "mixed" not in skip:
                log("mixed traffic ...")
                results["mixed"] = mixed_traffic.run(cluster, maker, mixed_s)
            if "goodput" not in skip:
                log("goodput sweep ...")
                results["goodput"] = goodput_sweep.run(cluster, maker, goodput_s)
    if "throughput" not in skip:
        log("decode throughput ...")
        results["throughput"] = decode_throughput.run()
    results["wall_s"] = time.monotonic() - started
    results["load_start"], results["load_end"] = load_start, os.getloadavg()
    write(results, args)


def write(results: dict[str, Any], args: argparse.Namespace) -> None:
    out: Path = args.out
    (out / "img").mkdir(parents=True, exist_ok=True)
    (out / "scenarios.json").write_text(json.dumps(results, indent=1) + "\n")
    if "mixed" in results:
        plots.latency_cdfs(results["mixed"], out / "img" / "scenarios_latency_cdf.png")
    if "goodput" in results:
        plots.goodput_vs_rate(results["goodput"], out / "img" / "scenarios_goodput.png")
    command = ".venv/bin/python -m bench.scenarios.run_all" + (" --quick" if args.quick else "")
    replace_section(out / "benchmarks.md", section(results, command))
    log(f"wrote {out / 'benchmarks.md'} ({results['wall_s'] / 60:.1f} min)")
    print("\n".join(verdicts(results)))


if __name__ == "__main__":
    main()
