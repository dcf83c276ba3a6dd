"""Every ``tandem:*`` Prometheus metric, defined here and nowhere else.

Names mirror vLLM's (``vllm:time_to_first_token_seconds`` -> ``tandem:time_to_first_token_seconds``,
counters gain ``_total`` on the wire as in vLLM), with the labels ``model_name``, ``role`` and
``replica``. The router serves them at ``GET /metrics``:

* **request metrics** are measured by the router, where the client sees them (``role="router"``):
  TTFT, inter-token latency (one observation per streamed chunk: the gap since the previous one),
  TPOT = (E2E - TTFT) / (tokens - 1), E2E, queue time, per-stage durations, prompt/generation
  tokens, finished requests by reason, failures, router decisions, admission rejections, goodput
  (requests meeting / missing the TTFT and TPOT SLOs), KV blocks moved per request;
* **worker metrics** (``role="prefill"`` / ``"decode"``, ``replica`` = the Serve replica) are read,
  at scrape time, from each worker's stats (asked of the worker by the router):
  running / waiting requests, KV usage, prefix-cache queries, hits and evictions (in blocks),
  preemptions,
  KV transfer bytes, completed / failed / in-flight transfers, queued prefill tokens, replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["PREFIX", "STAGES", "RouterMetrics", "WorkerMetricsCollector"]

PREFIX = "tandem:"
LABELS = ("model_name", "role", "replica")
STAGES = (
    "tokenize",
    "reserve",
    "queue",
    "prefix_lookup",
    "prefill",
    "transfer",
    "decode",
    "tool_wait",
)
"""`tandem:request_stage_seconds{stage=...}`: router tokenization and decode reservation; the
worker's queue, prefix lookup and prefill compute; the KV transfer after the first token; decode;
and tool wait (the gap since the same ``user``'s previous request finished: an agent's think or
tool time between turns)."""

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
            1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0,
            7680.0)  # fmt: skip
"""From vLLM's shortest (its TTFT histogram's 1 ms: a cached or short prompt's first token
and queue times come in under 5 ms) up to its longest (its E2E histogram's): past the default
600 s request timeout and a long `tool_wait`, so that slow requests' quantiles are not all the
last bucket's bound."""
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
              0.75, 1.0, 2.5, 5.0)  # fmt: skip
_BLOCKS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class RouterMetrics:
    """The router's request metrics, in their own registry (one per router replica)."""

    def __init__(self, model_name: str, replica: str) -> None:
        # No `<name>_created` series next to every counter and histogram (as vLLM): one more
        # series per label set that no dashboard reads. (A process-wide switch of the client.)
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "role": "router", "replica": replica}
        r = self.registry

        def hist(name: str, doc: str, buckets: Sequence[float], extra: tuple[str, ...] = ()) -> Any:
            return Histogram(PREFIX + name, doc, (*LABELS, *extra), buckets=buckets, registry=r)

        def count(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(PREFIX + name, doc, (*LABELS, *extra), registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Gap between streamed tokens (a chunk of n tokens after a gap g: n gaps of g / n).",
            _TOKEN_GAP,
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "(E2E - TTFT) / (output tokens - 1), per request with 2+ tokens.",
            _TOKEN_GAP,
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY)
        self.queue = hist(
            "request_queue_time_seconds", "Time waiting in a worker's queue.", _LATENCY
        )
        self.stage = hist(
            "request_stage_seconds", "Per-stage duration of a request.", _LATENCY, ("stage",)
        )
        self.blocks = hist(
            "kv_transfer_blocks_per_request", "KV blocks moved to decode per request.", _BLOCKS
        )
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = count("generation_tokens", "Generated tokens.")
        self.success = count(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.failure = count("request_failure", "Requests that failed, by error code.", ("code",))
        self.decisions = count(
            "router_decisions", "Routing decisions by policy and outcome.", ("policy", "outcome")
        )
        self.rejections = count(
            "admission_rejections", "Requests refused at arrival (429), by reason.", ("reason",)
        )
        self.retries = count(
            "request_retries",
            "Requests that went on without a worker they lost, by the lost worker's role and "
            "how: resumed (from the tokens sent) or restarted (nothing had been sent).",
            ("lost_role", "how"),
        )
        self.kv_resyncs = count(
            "prefix_index_resyncs",
            "Times the router re-read a worker's whole prefix cache, by the worker's role and "
            "why: gap (a batch of its KV events went missing) or digest (its count and XOR of "
            "its hashes differed from the router's copy).",
            ("worker_role", "reason"),
        )
        self.slo_met = count(
            "slo_met_requests", "Finished requests meeting the SLO (ttft, tpot, all).", ("slo",)
        )
        self.slo_missed = count(
            "slo_missed_requests", "Finished requests missing the SLO (ttft, tpot, all).", ("slo",)
        )
        self._last_finish: dict[str, float] = {}  # user -> when their last request finished
        self._itl_child = self._l(self.itl)
        # Series exist (at 0) from the start, so dashboards and rate() see them before traffic.
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.blocks,
                       self.prompt_tokens, self.generation_tokens):  # fmt: skip
            self._l(metric)
        for stage in STAGES:
            self._l(self.stage, stage=stage)
        for reason in ("stop", "length", "abort"):
            self._l(self.success, finished_reason=reason)
        for lost_role in ("prefill", "decode"):
            for how in ("resumed", "restarted"):
                self._l(self.retries, lost_role=lost_role, how=how)
        for slo in ("ttft", "tpot", "all"):
            self._l(self.slo_met, slo=slo)
            self._l(self.slo_missed, slo=slo)

    # ---- recording -------------------------------------------------------------------------------
    def _l(self, metric: Any, **extra: str) -> Any:
        return metric.labels(**self.labels, **extra)

    def token_gap(self, seconds: float, tokens: int = 1) -> None:
        """A streamed chunk of `tokens` tokens came `seconds` after the previous one: each of
        its tokens counts one gap of `seconds / tokens` (per token: the labelled child is kept)."""
        per_token = seconds / tokens
        for _ in range(tokens):
            self._itl_child.observe(per_token)

    def decision(self, policy: str, outcome: str) -> None:
        self._l(self.decisions, policy=policy, outcome=outcome).inc()

    def rejected(self, reason: str) -> None:
        self._l(self.rejections, reason=reason).inc()

    def failed(self, code: str) -> None:
        self._l(self.failure, code=code).inc()

    def retried(self, lost_worker_id: str, resumed: bool) -> None:
        """A request goes on without `lost_worker_id` ("<role>/<replica>")."""
        lost_role = lost_worker_id.partition("/")[0]
        how = "resumed" if resumed else "restarted"
        self._l(self.retries, lost_role=lost_role, how=how).inc()

    def kv_resynced(self, worker_role: str, reason: str) -> None:
        self._l(self.kv_resyncs, worker_role=worker_role, reason=reason).inc()

    def arrived(self, user: str | None, now: float) -> None:
        """Tool wait: the gap since this user's previous request finished (within 10 min)."""
        last = self._last_finish.get(user) if user else None
        if last is not None and 0 <= now - last <= 600:
            self._l(self.stage, stage="tool_wait").observe(now - last)

    def finished(
        self,
        *,
        user: str | None,
        arrival: float,
        first_token: float | None,
        end: float,
        prompt_tokens: int,
        output_tokens: int,
        finish_reason: str,
        stages_s: dict[str, float],
        transferred_blocks: int | None,
        slo_ttft_s: float | None,
        slo_tpot_s: float | None,
    ) -> None:
        """One finished request: latencies, tokens, stages, goodput."""
        self._l(self.success, finished_reason=finish_reason).inc()
        self._l(self.prompt_tokens).inc(prompt_tokens)
        self._l(self.generation_tokens).inc(output_tokens)
        e2e = end - arrival
        self._l(self.e2e).observe(e2e)
        ttft = (first_token - arrival) if first_token is not None else None
        if ttft is not None:
            self._l(self.ttft).observe(ttft)
        tpot = (
            (e2e - ttft) / (output_tokens - 1) if ttft is not None and output_tokens > 1 else None
        )
        if tpot is not None:
            self._l(self.tpot).observe(tpot)
        for stage, seconds in stages_s.items():
            self._l(self.stage, stage=stage).observe(max(0.0, seconds))
        if "queue" in stages_s:
            self._l(self.queue).observe(max(0.0, stages_s["queue"]))
        if transferred_blocks is not None:
            self._l(self.blocks).observe(transferred_blocks)
        ttft_ok = slo_ttft_s is None or (ttft is not None and ttft <= slo_ttft_s)
        tpot_ok = slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s
        for slo, ok in (("ttft", ttft_ok), ("tpot", tpot_ok), ("all", ttft_ok and tpot_ok)):
            self._l(self.slo_met if ok else self.slo_missed, slo=slo).inc()
        if user:
            if len(self._last_finish) > 10_000:
                self._last_finish.clear()
            self._last_finish[user] = end


# (stat key, metric name, help, kind): worker stats exported as they are.
_WORKER_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "num_requests_running", "Requests in the running batch.", "gauge"),
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("kv_cache_usage", "kv_cache_usage_perc", "KV-cache usage (1 = full).", "gauge"),
    ("prefix_cache_queried_blocks", "prefix_cache_queries", "Blocks looked up in the prefix cache.", "counter"),
    ("prefix_cache_hit_blocks", "prefix_cache_hits", "Blocks found in the prefix cache.", "counter"),
    ("num_preemptions", "num_preemptions", "Preempted requests.", "counter"),
    ("prefix_cache_evicted_blocks", "prefix_cache_evictions", "Cached blocks evicted.", "counter"),
    ("kv_transfer_bytes", "kv_transfer_bytes", "KV page bytes sent to decode.", "counter"),
    ("kv_transfers_done", "kv_transfers", "KV transfers completed.", "counter"),
    ("kv_transfers_failed", "kv_transfer_failures", "KV transfers failed.", "counter"),
    ("num_transfers", "kv_transfers_in_flight", "KV transfers in flight.", "gauge"),
    ("num_waiting_tokens", "num_queued_prefill_tokens", "Prompt tokens not yet prefilled.", "gauge"),
    ("prefill_tokens_per_s", "prefill_tokens_per_second", "Measured prefill throughput.", "gauge"),
    ("num_cancelled", "num_cancelled_requests", "Requests cancelled on the worker: by their client, or on prefill by the router (a prefill begun before its decode reservation had to wait starts again with its grant).", "counter"),
    ("num_step_failures", "engine_step_failures", "Engine steps that failed (their requests failed).", "counter"),
)  # fmt: skip


class WorkerMetricsCollector(Collector):
    """Worker metrics from the latest registry stats, at scrape time. ``workers()`` returns
    ``(role, replica, stats)`` triples; ``replica_targets()`` the replicas each role should have
    (configured or autoscaling), exported next to the live count."""

    def __init__(
        self,
        model_name: str,
        workers: Callable[[], Iterable[tuple[str, str, dict[str, Any]]]],
        replica_targets: Callable[[], dict[str, int]],
        other_replicas: Callable[[], dict[str, int]] = dict,
    ) -> None:
        """`other_replicas`: live replicas of roles that report no stats (the router's)."""
        self.model_name = model_name
        self.workers = workers
        self.replica_targets = replica_targets
        self.other_replicas = other_replicas

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected lazily: never called at registration

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for key, name, doc, kind in _WORKER_SERIES:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            families[key] = cls(PREFIX + name, doc, labels=LABELS)
        replicas = GaugeMetricFamily(
            PREFIX + "role_replicas", "Live replicas per role.", labels=("model_name", "role")
        )
        targets = GaugeMetricFamily(
            PREFIX + "role_target_replicas",
            "Replicas each role should have (autoscaling target).",
            labels=("model_name", "role"),
        )
        live: dict[str, int] = dict(self.other_replicas())
        for role, replica, stats in self.workers():
            live[role] = live.get(role, 0) + 1
            for key, family in families.items():
                value = stats.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric([self.model_name, role, replica], float(value))
        for role, target in self.replica_targets().items():
            targets.add_metric([self.model_name, role], float(target))
            replicas.add_metric([self.model_name, role], float(live.get(role, 0)))
        yield from families.values()
        yield replicas
        yield targets
