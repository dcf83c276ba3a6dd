"""What each dashboard shows: titles, units and PromQL, as plain data (no Grafana SDK needed).

`build.py` turns these into Grafana JSON; the tests evaluate every expression against a real
Prometheus. Windows are a fixed ``[1m]`` so the expressions also run outside Grafana.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DASHBOARDS", "Dashboard", "Panel", "Query"]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    panels: tuple[Panel, ...]


def _quantiles(
    metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)
) -> tuple[Query, ...]:
    group = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[1m])))",
            f"{prefix}p{round(q * 100)}",
        )
        for q in qs
    )


def _rate(metric: str, by: str = "", legend: str = "") -> Query:
    group = f" by ({by})" if by else ""
    return Query(f"sum{group} (rate({metric}[1m]))", legend or (f"{{{{{by}}}}}" if by else metric))


# Every router replica exports the workers' series (read from them at scrape time) with the
# same labels, and the role counts: scraped from several router replicas, each is there once
# per replica, so these take one copy (`max by`) before summing.
def _workers(series: str) -> str:
    return f"max by (role, replica) ({series})"


def _worker_rate(metric: str, by: str = "", legend: str = "") -> Query:
    group = f" by ({by})" if by else ""
    return Query(
        f"sum{group} ({_workers(f'rate({metric}[1m])')})",
        legend or (f"{{{{{by}}}}}" if by else metric),
    )


OVERVIEW = Dashboard(
    "tandem-overview",
    "tandem / Overview",
    (
        Panel("Time to first token", "s", _quantiles("tandem:time_to_first_token_seconds")),
        Panel("Inter-token latency", "s", _quantiles("tandem:inter_token_latency_seconds")),
        Panel(
            "Time per output token",
            "s",
            _quantiles("tandem:request_time_per_output_token_seconds"),
        ),
        Panel("End-to-end latency", "s", _quantiles("tandem:e2e_request_latency_seconds")),
        Panel(
            "Requests / s",
            "reqps",
            (_rate("tandem:request_success_total", "finished_reason"),),
            "Finished requests by finish reason.",
        ),
        Panel(
            "Tokens / s",
            "short",
            (
                _rate("tandem:prompt_tokens_total", legend="prompt"),
                _rate("tandem:generation_tokens_total", legend="generation"),
            ),
        ),
        Panel(
            "Goodput and SLO attainment",
            "short",
            (
                _rate('tandem:slo_met_requests_total{slo="all"}', legend="goodput (req/s)"),
                Query(
                    'sum(increase(tandem:slo_met_requests_total{slo="all"}[5m])) / clamp_min('
                    'sum(increase(tandem:slo_met_requests_total{slo="all"}[5m])) + '
                    'sum(increase(tandem:slo_missed_requests_total{slo="all"}[5m])), 1)',
                    "SLO attainment (0-1)",
                ),
            ),
            "Requests meeting both the TTFT and TPOT targets (`slo` in the cluster config).",
        ),
        Panel(
            "Errors and refusals / s",
            "reqps",
            (
                _rate("tandem:request_failure_total", "code"),
                _rate("tandem:admission_rejections_total", "reason"),
                _rate(
                    "tandem:request_retries_total",
                    "lost_role, how",
                    "{{how}} without a lost {{lost_role}} worker",
                ),
            ),
            "Failed requests by error code; requests refused at arrival (429) by reason; "
            "requests that went on without a worker they lost (it died), by its role.",
        ),
    ),
)

KV_CACHE = Dashboard(
    "tandem-kv-cache",
    "tandem / KV cache",
    (
        Panel(
            "KV-cache usage",
            "percentunit",
            (Query(_workers("tandem:kv_cache_usage_perc"), "{{role}} {{replica}}"),),
        ),
        Panel(
            "Prefix-cache hit rate",
            "percentunit",
            (
                Query(
                    f"sum by (role) ({_workers('rate(tandem:prefix_cache_hits_total[1m])')})"
                    " / clamp_min(sum by (role) "
                    f"({_workers('rate(tandem:prefix_cache_queries_total[1m])')}), 1e-9)",
                    "{{role}}",
                ),
            ),
            "Blocks found / blocks looked up.",
        ),
        Panel(
            "Preemptions and evictions / s",
            "short",
            (
                _worker_rate("tandem:num_preemptions_total", "role", "preemptions {{role}}"),
                _worker_rate(
                    "tandem:prefix_cache_evictions_total", "role", "evicted blocks {{role}}"
                ),
            ),
        ),
        Panel(
            "Running and waiting requests",
            "short",
            (
                Query(
                    f"sum by (role) ({_workers('tandem:num_requests_running')})", "running {{role}}"
                ),
                Query(
                    f"sum by (role) ({_workers('tandem:num_requests_waiting')})", "waiting {{role}}"
                ),
            ),
        ),
    ),
)

DISAGGREGATION = Dashboard(
    "tandem-disaggregation",
    "tandem / Disaggregation",
    (
        Panel(
            "KV transfer throughput",
            "GBs",
            (Query(f"sum({_workers('rate(tandem:kv_transfer_bytes_total[1m])')}) / 1e9", "GB/s"),),
        ),
        Panel(
            "KV transfer time after the first token",
            "s",
            tuple(
                Query(
                    f"histogram_quantile({q}, sum by (le) "
                    f'(rate(tandem:request_stage_seconds_bucket{{stage="transfer"}}[1m])))',
                    f"p{round(q * 100)}",
                )
                for q in (0.5, 0.99)
            ),
        ),
        Panel(
            "KV transfers: completed, failed, in flight",
            "short",
            (
                _worker_rate("tandem:kv_transfers_total", legend="completed / s"),
                _worker_rate("tandem:kv_transfer_failures_total", legend="failed / s"),
                Query(f"sum({_workers('tandem:kv_transfers_in_flight')})", "in flight"),
            ),
        ),
        Panel(
            "KV blocks moved per request",
            "short",
            (
                Query(
                    "sum(rate(tandem:kv_transfer_blocks_per_request_sum[1m])) / clamp_min("
                    "sum(rate(tandem:kv_transfer_blocks_per_request_count[1m])), 1e-9)",
                    "mean",
                ),
            ),
        ),
        Panel(
            "Request stages (median)",
            "s",
            (
                Query(
                    "histogram_quantile(0.5, sum by (le, stage) "
                    "(rate(tandem:request_stage_seconds_bucket[1m])))",
                    "{{stage}}",
                ),
            ),
            "tokenize, reserve, queue, prefix lookup, prefill, transfer, decode, tool wait.",
        ),
        Panel(
            "Router decisions / s",
            "reqps",
            (
                Query(
                    "sum by (policy, outcome) (rate(tandem:router_decisions_total[1m]))",
                    "{{policy}} {{outcome}}",
                ),
            ),
        ),
    ),
)

ROLES = Dashboard(
    "tandem-roles",
    "tandem / Roles",
    (
        Panel(
            "Replicas per role: target vs actual",
            "short",
            (
                Query("max by (role) (tandem:role_replicas)", "actual {{role}}"),
                Query("max by (role) (tandem:role_target_replicas)", "target {{role}}"),
            ),
        ),
        Panel(
            "Queues",
            "short",
            (
                Query(
                    f"sum by (role) ({_workers('tandem:num_requests_waiting')})", "waiting {{role}}"
                ),
                Query(
                    "sum(" + _workers('tandem:num_queued_prefill_tokens{role="prefill"}') + ")",
                    "queued prefill tokens",
                ),
            ),
        ),
        Panel(
            "Queue time",
            "s",
            _quantiles("tandem:request_queue_time_seconds", qs=(0.5, 0.99)),
        ),
        Panel(
            "Prefill throughput",
            "short",
            (
                Query(
                    _workers('tandem:prefill_tokens_per_second{role="prefill"}'),
                    "{{replica}} tokens/s",
                ),
            ),
        ),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (OVERVIEW, KV_CACHE, DISAGGREGATION, ROLES)
