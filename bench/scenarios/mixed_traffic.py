"""Mixed traffic: short-request TTFT p99 and ITL p99 with and without chunked prefill, and PD.

For each configuration: the short requests alone, one at a time (the no-load TTFT), then the
whole mix at its request rate. Target: short-request TTFT p99 under the mix <= 2x its no-load
value with chunked prefill or with PD.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from tandem.bench.scenarios.cluster import ScenarioCluster
from tandem.bench.scenarios.settings import CONFIGS, MixedScenario
from tandem.bench.serving.benchmark import run_benchmark
from tandem.bench.serving.datasets import mixed_dataset
from tandem.bench.serving.metrics import calculate_metrics
from tandem.bench.serving.prompts import PromptMaker
from tandem.bench.serving.records import RequestRecord
from tandem.bench.serving.runner import LoadConfig

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _short_stats(records: list[RequestRecord], duration: float) -> dict[str, float]:
    short = [r for r in records if r.category == "short"]
    m = calculate_metrics(short, duration, percentiles=(50, 90, 99))
    return {
        "ttft_p50_ms": m.stats["ttft"].percentiles[50],
        "ttft_p99_ms": m.stats["ttft"].percentiles[99],
        "itl_p99_ms": m.stats["itl"].percentiles[99],
        "tpot_p99_ms": m.stats["tpot"].percentiles[99],
    }


def _tokens_per_chunk(records: list[RequestRecord]) -> float:
    ok = [r for r in records if r.success]
    chunks = sum(len(r.itl) + 1 for r in ok)
    return sum(r.output_tokens for r in ok) / chunks if chunks else 0.0


def run(cluster: ScenarioCluster, maker: PromptMaker, s: MixedScenario) -> dict[str, Any]:
    conversations = mixed_dataset(maker, random.Random(s.seed), s.num_prompts, s.spec)
    shorts = [c for c in conversations if c.category == "short"][: s.no_load_prompts]
    out: dict[str, Any] = {"settings": dataclasses.asdict(s), "configs": {}}
    for name in s.configs:
        url = cluster.deploy(**CONFIGS[name])
        base = LoadConfig(url, "bench", extra_body=GREEDY, seed=s.seed, progress=False)
        idle = run_benchmark(dataclasses.replace(base, max_concurrency=1), shorts, maker)
        loaded = run_benchmark(
            dataclasses.replace(base, request_rate=s.request_rate), conversations, maker
        )
        no_load = _short_stats(idle.records, idle.metrics.duration)
        under_load = _short_stats(loaded.records, loaded.metrics.duration)
        all_itl = loaded.metrics.stats["itl"].percentiles
        out["configs"][name] = {
            "no_load_short": no_load,
            "mixed_short": under_load,
            "ttft_p99_ratio": under_load["ttft_p99_ms"] / no_load["ttft_p99_ms"],
            "itl_p99_all_ms": all_itl[99],
            "completed": loaded.metrics.completed,
            "failed": loaded.metrics.failed,
            "duration_s": loaded.metrics.duration,
            "tokens_per_chunk": _tokens_per_chunk(loaded.records),
            "short_ttfts_s": [
                r.ttft for r in loaded.records if r.success and r.category == "short"
            ],
            "no_load_ttfts_s": [r.ttft for r in idle.records if r.success],
            "itls_s": [gap for r in loaded.records if r.success for gap in r.itl],
            "result": {k: v for k, v in loaded.result.items() if k != "categories"},
        }
    return out
