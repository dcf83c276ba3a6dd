"""Goodput sweep: SLO attainment and request_goodput at each rate, colocated vs PD (same CPU).

The DistServe-style figure is the highest request rate at which at least 90% of requests meet
every SLO (TTFT and TPOT), interpolated linearly between the measured rates.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from tandem.bench.scenarios.cluster import ScenarioCluster
from tandem.bench.scenarios.settings import CONFIGS, GoodputScenario
from tandem.bench.serving.benchmark import run_benchmark
from tandem.bench.serving.datasets import random_dataset
from tandem.bench.serving.prompts import PromptMaker
from tandem.bench.serving.runner import LoadConfig

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def max_rate_meeting(points: Sequence[tuple[float, float]], target: float) -> tuple[float, str]:
    """(rate, how): the highest rate whose attainment (and every lower rate's) is >= `target`,
    interpolated to where attainment crosses `target` before the next measured rate."""
    points = sorted(points)
    if not points:
        return 0.0, "no points"
    best: tuple[float, float] | None = None
    for rate, attained in points:
        if attained < target:
            if best is None:
                return 0.0, f"below target already at {rate:g} req/s"
            r0, a0 = best
            return r0 + (a0 - target) / (a0 - attained) * (rate - r0), "interpolated"
        best = (rate, attained)
    return points[-1][0], "met at every measured rate (a lower bound)"


def run(cluster: ScenarioCluster, maker: PromptMaker, s: GoodputScenario) -> dict[str, Any]:
    out: dict[str, Any] = {"settings": dataclasses.asdict(s), "configs": {}}
    for name in s.configs:
        url = cluster.deploy(**CONFIGS[name])
        rows = []
        for i, rate in enumerate(s.rates):
            n = max(12, round(rate * s.seconds_per_rate))
            convs = random_dataset(
                maker, random.Random(s.seed + i), n, s.input_len, s.output_len, s.range_ratio
            )
            load = LoadConfig(
                url, "bench", request_rate=rate, seed=s.seed + i, extra_body=GREEDY, progress=False
            )
            run_ = run_benchmark(load, convs, maker, slos=s.slos_ms)
            m = run_.metrics
            rows.append(
                {
                    "rate": rate,
                    "requests": n,
                    "attainment": m.good_fraction or 0.0,
                    "request_goodput": m.request_goodput or 0.0,
                    "request_throughput": m.request_throughput,
                    "failed": m.failed,
                    "p90_ttft_ms": m.stats["ttft"].percentiles[90],
                    "p90_tpot_ms": m.stats["tpot"].percentiles[90],
                }
            )
        max_rate, how = max_rate_meeting(
            [(r["rate"], r["attainment"]) for r in rows], s.attainment_target
        )
        out["configs"][name] = {"rows": rows, "max_rate": max_rate, "max_rate_how": how}
    return out
