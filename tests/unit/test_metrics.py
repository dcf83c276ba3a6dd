"""The tandem:* metrics: hand-computed request figures, goodput, worker series (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.metrics import RouterMetrics, WorkerMetricsCollector


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: RouterMetrics, name: str, **labels: str) -> float:
    want = {"model_name": "m", "role": "router", "replica": "r1", **labels}
    for (sample, sample_labels), v in samples(metrics).items():
        if sample == name and dict(sample_labels) == want:
            return v
    raise KeyError(f"{name} {labels}")


def test_a_finished_request_is_recorded_exactly() -> None:
    m = RouterMetrics("m", "r1")
    m.finished(
        user=None, arrival=100.0, first_token=100.25, end=101.25, prompt_tokens=40,
        output_tokens=5, finish_reason="length",
        stages_s={"queue": 0.05, "prefill": 0.1, "transfer": 0.02, "decode": 1.0},
        transferred_blocks=3, slo_ttft_s=0.2, slo_tpot_s=0.3,
    )  # fmt: skip
    assert value(m, "tandem:request_success_total", finished_reason="length") == 1
    assert value(m, "tandem:prompt_tokens_total") == 40
    assert value(m, "tandem:generation_tokens_total") == 5
    assert value(m, "tandem:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(m, "tandem:time_to_first_token_seconds_count") == 1
    assert value(m, "tandem:e2e_request_latency_seconds_sum") == pytest.approx(1.25)
    # TPOT = (1.25 - 0.25) / (5 - 1) = 0.25
    assert value(m, "tandem:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    assert value(m, "tandem:request_queue_time_seconds_sum") == pytest.approx(0.05)
    assert value(m, "tandem:request_stage_seconds_sum", stage="decode") == pytest.approx(1.0)
    assert value(m, "tandem:kv_transfer_blocks_per_request_sum") == 3
    # TTFT 0.25 > 0.2 misses; TPOT 0.25 <= 0.3 meets; both: missed.
    assert value(m, "tandem:slo_missed_requests_total", slo="ttft") == 1
    assert value(m, "tandem:slo_met_requests_total", slo="tpot") == 1
    assert value(m, "tandem:slo_missed_requests_total", slo="all") == 1


def test_a_slow_request_lands_in_a_bucket_below_the_request_timeout() -> None:
    """A 300 s request (the default timeout is 600 s) is told apart from an 80 s one: the
    latency buckets reach vLLM's longest (7,680 s), not 80 s."""
    m = RouterMetrics("m", "r1")
    m.finished(
        user=None, arrival=0.0, first_token=200.0, end=300.0, prompt_tokens=4,
        output_tokens=3, finish_reason="length", stages_s={}, transferred_blocks=0,
        slo_ttft_s=None, slo_tpot_s=None,
    )  # fmt: skip
    e2e = "tandem:e2e_request_latency_seconds_bucket"
    assert value(m, e2e, le="160.0") == 0 and value(m, e2e, le="320.0") == 1
    ttft = "tandem:time_to_first_token_seconds_bucket"
    assert value(m, ttft, le="160.0") == 0 and value(m, ttft, le="320.0") == 1
    assert value(m, e2e, le="7680.0") == 1


def test_one_token_request_has_no_tpot_and_meets_the_tpot_slo() -> None:
    m = RouterMetrics("m", "r1")
    m.finished(
        user="u", arrival=0.0, first_token=0.1, end=0.1, prompt_tokens=3, output_tokens=1,
        finish_reason="stop", stages_s={}, transferred_blocks=None, slo_ttft_s=0.5,
        slo_tpot_s=0.01,
    )  # fmt: skip
    assert value(m, "tandem:request_time_per_output_token_seconds_count") == 0
    assert value(m, "tandem:slo_met_requests_total", slo="all") == 1
    assert value(m, "tandem:kv_transfer_blocks_per_request_count") == 0
    # The same user comes back 2 s later: 2 s of tool wait.
    m.arrived("u", 2.1)
    assert value(m, "tandem:request_stage_seconds_sum", stage="tool_wait") == pytest.approx(2.0)
    m.arrived("someone-else", 2.1)
    assert value(m, "tandem:request_stage_seconds_count", stage="tool_wait") == 1


def test_decisions_rejections_failures_and_gaps() -> None:
    m = RouterMetrics("m", "r1")
    m.decision("cache_affinity", "prefill_prefix_hit")
    m.decision("cache_affinity", "prefill_prefix_hit")
    m.rejected("deadline")
    m.failed("invalid_request")
    for gap in (0.01, 0.03):
        m.token_gap(gap)
    m.token_gap(0.06, 3)  # a chunk of 3 tokens 60 ms after the last: 3 gaps of 20 ms
    assert value(m, "tandem:router_decisions_total", policy="cache_affinity",
                 outcome="prefill_prefix_hit") == 2  # fmt: skip
    assert value(m, "tandem:admission_rejections_total", reason="deadline") == 1
    assert value(m, "tandem:request_failure_total", code="invalid_request") == 1
    assert value(m, "tandem:inter_token_latency_seconds_count") == 5
    assert value(m, "tandem:inter_token_latency_seconds_sum") == pytest.approx(0.1)
    assert value(m, "tandem:inter_token_latency_seconds_bucket", le="0.02") == 4


def test_worker_series_come_from_the_reported_stats() -> None:
    m = RouterMetrics("m", "r1")
    workers: list[tuple[str, str, dict[str, Any]]] = [
        ("prefill", "p1", {"num_requests_running": 2, "prefix_cache_hit_blocks": 7,
                           "kv_transfer_bytes": 4096, "num_transfers": 1, "role": "prefill"}),
        ("decode", "d1", {"kv_cache_usage": 0.25, "num_preemptions": 3, "error": "x"}),
    ]  # fmt: skip
    m.registry.register(
        WorkerMetricsCollector(
            "m", lambda: workers, lambda: {"decode": 2, "router": 2}, lambda: {"router": 2}
        )
    )
    got = samples(m)

    def worker(name: str, role: str, replica: str) -> float:
        key = (name, (("model_name", "m"), ("replica", replica), ("role", role)))
        return got[key]

    assert worker("tandem:num_requests_running", "prefill", "p1") == 2
    assert worker("tandem:prefix_cache_hits_total", "prefill", "p1") == 7
    assert worker("tandem:kv_transfer_bytes_total", "prefill", "p1") == 4096
    assert worker("tandem:kv_transfers_in_flight", "prefill", "p1") == 1
    assert worker("tandem:kv_cache_usage_perc", "decode", "d1") == 0.25
    assert worker("tandem:num_preemptions_total", "decode", "d1") == 3
    assert got[("tandem:role_target_replicas", (("model_name", "m"), ("role", "decode")))] == 2
    assert got[("tandem:role_replicas", (("model_name", "m"), ("role", "decode")))] == 1
    # The router reports no worker stats: its live count comes from Serve's status.
    assert got[("tandem:role_replicas", (("model_name", "m"), ("role", "router")))] == 2


def test_no_created_series_beside_the_counters_and_histograms() -> None:
    m = RouterMetrics("m", "r1")
    m.finished(
        user=None, arrival=1.0, first_token=1.1, end=1.5, prompt_tokens=4, output_tokens=2,
        finish_reason="stop", stages_s={}, transferred_blocks=0, slo_ttft_s=None, slo_tpot_s=None,
    )  # fmt: skip
    names = {name for name, _ in samples(m)}
    assert "tandem:request_success_total" in names
    assert not [n for n in names if n.endswith("_created")]


def test_a_fast_first_token_is_told_apart_below_five_milliseconds() -> None:
    """A cached prompt's first token in 2 ms and one in 4 ms fall in different buckets (all
    of them were in the first, 5 ms, and the dashboard's p50 guessed inside it)."""
    m = RouterMetrics("m", "r1")
    for first_token in (0.0008, 0.002, 0.004):
        m.finished(
            user=None, arrival=0.0, first_token=first_token, end=0.01, prompt_tokens=4,
            output_tokens=3, finish_reason="length", stages_s={}, transferred_blocks=0,
            slo_ttft_s=None, slo_tpot_s=None,
        )  # fmt: skip
    ttft = "tandem:time_to_first_token_seconds_bucket"
    assert [value(m, ttft, le=le) for le in ("0.001", "0.0025", "0.005")] == [1, 2, 3]
