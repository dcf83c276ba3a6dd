"""Summary metrics from per-request records, with `vllm bench serve`'s definitions.

- Only successful requests enter the latency statistics and token totals; failed ones are
  counted (`failed`). Throughputs divide by the benchmark's wall-clock duration.
- TPOT statistics skip requests with a single output token; goodput counts their TPOT as 0.
- ITL statistics pool every request's gaps between streamed chunks.
- A request is *good* when every SLO given (`ttft`, `tpot`, `e2el`, milliseconds) holds
  (value <= SLO); `request_goodput` is good requests per second.
- Statistics are numpy's: mean, median, population std, linearly interpolated percentiles.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.bench.serving.records import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Stats:
    """One metric's statistics in milliseconds; `percentiles` maps p (e.g. 99.0) to its value."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Iterable[float]) -> Stats:
        ms = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000.0
        return cls(
            mean=float(np.mean(ms)),
            median=float(np.median(ms)),
            std=float(np.std(ms)),
            percentiles={float(p): float(np.percentile(ms, p)) for p in percentiles},
        )


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    request_goodput: float | None  # None without SLOs
    output_throughput: float
    total_token_throughput: float
    stats: dict[str, Stats] = field(default_factory=dict)  # keyed by METRICS

    @property
    def good_fraction(self) -> float | None:
        """SLO attainment: good requests over all requests (failed ones miss)."""
        total = self.completed + self.failed
        if self.request_goodput is None or total == 0:
            return None
        return self.request_goodput * self.duration / total


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        for part in item.split():
            name, sep, value = part.partition(":")
            if not sep or name not in SLO_METRICS:
                raise ValueError(
                    f"goodput SLO {part!r}: expected NAME:MS with NAME in {SLO_METRICS}"
                )
            ms = float(value)
            if ms < 0:
                raise ValueError(f"goodput SLO {part!r}: milliseconds must be >= 0")
            slos[name] = ms
    return slos


def is_good(record: RequestRecord, slos: dict[str, float]) -> bool:
    """The request succeeded and meets every SLO in `slos` (milliseconds)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slos.items())


def calculate_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    slos: dict[str, float] | None = None,
    percentiles: Iterable[float] = (90, 99),
) -> BenchmarkMetrics:
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    pcts = list(percentiles)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    goodput = None
    if slos:
        goodput = sum(is_good(r, slos) for r in ok) / duration
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input=total_input,
        total_output=total_output,
        duration=duration,
        request_throughput=len(ok) / duration,
        request_goodput=goodput,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        stats={name: Stats.of(values, pcts) for name, values in series.items()},
    )
