"""The saved result (`vllm bench serve --save-result` keys) and the printed summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tandem.bench.serving.metrics import METRICS, BenchmarkMetrics, calculate_metrics
from tandem.bench.serving.records import RequestRecord

TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def _pct_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def metrics_dict(m: BenchmarkMetrics, shown: Sequence[str] = METRICS) -> dict[str, Any]:
    """The summary keys: duration, counts, throughputs, and `{mean,median,std,pNN}_{metric}_ms`
    of the `shown` metrics (vLLM's --percentile-metrics)."""
    out: dict[str, Any] = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
    }
    for name in shown:
        s = m.stats[name]
        out[f"mean_{name}_ms"] = s.mean
        out[f"median_{name}_ms"] = s.median
        out[f"std_{name}_ms"] = s.std
        for p, value in s.percentiles.items():
            out[f"p{_pct_word(p)}_{name}_ms"] = value
    return out


def result_json(
    metrics: BenchmarkMetrics,
    records: Sequence[RequestRecord],
    info: dict[str, Any],
    *,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = (90, 99),
    detailed: bool = False,
    shown: Sequence[str] = METRICS,
) -> dict[str, Any]:
    """`info`: the run's settings (model_id, request_rate, ...). Adds per-category summaries
    (`categories`) and, with `detailed`, vLLM's per-request arrays in the order sent."""
    rate = info.get("request_rate")
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",  # (`info` may name another: vLLM's "vllm" backend)
        **info,
        "request_rate": "inf" if isinstance(rate, float) and math.isinf(rate) else rate,
        "goodput_slos_ms": slos or None,
        "slo_attainment": metrics.good_fraction,
        **metrics_dict(metrics, shown),
    }
    result["max_output_tokens_per_s"], result["max_concurrent_requests"] = peaks(records)
    failures = [r.error for r in records if not r.success]
    result["error_counts"] = {e: failures.count(e) for e in sorted(set(failures))}
    categories = sorted({r.category for r in records})
    if len(categories) > 1:
        result["categories"] = {
            cat: metrics_dict(
                calculate_metrics(
                    [r for r in records if r.category == cat], metrics.duration, slos, percentiles
                ),
                shown,
            )
            for cat in categories
        }
    if detailed:
        result.update(
            input_lens=[r.prompt_len for r in records],
            output_lens=[r.output_tokens if r.success else 0 for r in records],
            ttfts=[r.ttft for r in records],
            itls=[r.itl for r in records],
            latencies=[r.latency for r in records],
            start_times=[r.start_time for r in records],
            generated_texts=[r.generated_text for r in records],
            errors=[r.error for r in records],
            request_categories=[r.category for r in records],
        )
    return result


def peaks(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """vLLM's `max_output_tokens_per_s` and `max_concurrent_requests`: over the run cut into
    whole seconds from the first request sent, the most streamed chunks (a token each, as
    vLLM counts them) in one second, and the most successful requests under way in one."""
    done = [r for r in records if r.success]
    if not done:
        return 0.0, 0
    origin = min(r.start_time for r in done)
    chunks: dict[int, int] = {}
    running: dict[int, int] = {}
    for r in done:
        at = r.start_time + r.ttft
        for gap in [0.0, *r.itl]:
            at += gap
            second = int(at - origin)
            chunks[second] = chunks.get(second, 0) + 1
        for second in range(int(r.start_time - origin), int(r.start_time + r.latency - origin) + 1):
            running[second] = running.get(second, 0) + 1
    return float(max(chunks.values(), default=0)), max(running.values(), default=0)


def summary_text(
    m: BenchmarkMetrics,
    errors: Sequence[str] = (),
    records: Sequence[RequestRecord] = (),
    shown: Sequence[str] = METRICS,
) -> str:
    """`vllm bench serve`'s printed table (its peaks with the `records`), with the `shown`
    metrics' statistics."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: float | int | None, fmt: str = ".2f") -> None:
        shown = "-" if value is None else format(value, fmt)
        lines.append(f"{label:<40} {shown:<10}")

    row("Successful requests:", m.completed, "d")
    row("Failed requests:", m.failed, "d")
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input, "d")
    row("Total generated tokens:", m.total_output, "d")
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput)
        row("SLO attainment (%):", 100 * (m.good_fraction or 0.0))
    row("Output token throughput (tok/s):", m.output_throughput)
    if records:
        peak_tokens, peak_running = peaks(records)
        row("Peak output token throughput (tok/s):", peak_tokens)
        row("Peak concurrent requests:", peak_running, "d")
    row("Total Token throughput (tok/s):", m.total_token_throughput)
    for name in shown:
        short, title = TITLES[name]
        s = m.stats[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", s.mean)
        row(f"Median {short} (ms):", s.median)
        row(f"Std {short} (ms):", s.std)
        for p, value in s.percentiles.items():
            row(f"P{_pct_word(p)} {short} (ms):", value)
    distinct = sorted({e for e in errors if e})
    if distinct:
        lines.append("{s:{c}^{n}}".format(s="Errors", n=50, c="-"))
        for err in distinct[:10]:
            count = sum(1 for e in errors if e == err)
            lines.append(f"{count:>5} x {err[:200]}")
    lines.append("=" * 50)
    return "\n".join(lines)
