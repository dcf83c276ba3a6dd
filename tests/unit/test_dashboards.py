"""The committed Grafana JSON is what `deploy/dashboards/build.py` builds; panels are sane."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.deploy.dashboards import build
from tandem.deploy.dashboards.panels import DASHBOARDS

DIR = Path(build.__file__).resolve().parent


def test_committed_json_is_up_to_date() -> None:
    assert build.main(["--check", "--out", str(DIR)]) == 0


def test_every_panel_has_queries_on_tandem_metrics() -> None:
    titles = {b.title for b in DASHBOARDS}
    assert titles == {
        "tandem / Overview", "tandem / KV cache", "tandem / Disaggregation", "tandem / Roles",
    }  # fmt: skip
    for name in ("overview", "kv-cache", "disaggregation", "roles"):
        board = json.loads((DIR / f"{name}.json").read_text())
        assert board["panels"], name
        for panel in board["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"] and all("tandem:" in t["expr"] for t in panel["targets"])


# Series every router replica exports alike (read from the workers at scrape time, or the
# role counts): with two router replicas scraped, a plain `sum` counted each of them twice.
_SAME_ON_EVERY_ROUTER = {
    "role, replica": (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_evictions_total",
        "num_preemptions_total", "kv_transfer_bytes_total", "kv_transfers_total",
        "kv_transfer_failures_total", "kv_transfers_in_flight", "num_queued_prefill_tokens",
        "prefill_tokens_per_second", "num_cancelled_requests_total", "engine_step_failures_total",
    ),
    "role": ("role_replicas", "role_target_replicas"),
}  # fmt: skip


def test_series_every_router_replica_exports_are_counted_once() -> None:
    import re

    for name in ("overview", "kv-cache", "disaggregation", "roles"):
        board = json.loads((DIR / f"{name}.json").read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for by, metrics in _SAME_ON_EVERY_ROUTER.items():
                    for metric in metrics:
                        for hit in re.finditer(rf"tandem:{metric}\b", expr):
                            before = expr[: hit.start()]
                            assert re.search(rf"max by \({by}\) \((rate\()?$", before), (
                                f"{name} / {panel['title']}: {expr}"
                            )


def test_every_series_is_limited_to_the_chosen_jobs() -> None:
    """Two releases scraped by one Prometheus: each dashboard's `job` variable (all by
    default) picks one; a selector without it would mix both releases' series."""
    import re

    assert build.scoped('rate(tandem:a_total{stage="x"}[1m]) / tandem:b') == (
        'rate(tandem:a_total{stage="x", job=~"$job"}[1m]) / tandem:b{job=~"$job"}'
    )
    for name in ("overview", "kv-cache", "disaggregation", "roles"):
        board = json.loads((DIR / f"{name}.json").read_text())
        job = next(v for v in board["templating"]["list"] if v["name"] == "job")
        assert job["query"] == "label_values(tandem:role_replicas, job)"
        assert (job["includeAll"], job["allValue"], job["current"]["value"]) == (
            True, ".*", ["$__all"],
        )  # fmt: skip
        for panel in board["panels"]:
            for target in panel["targets"]:
                selectors = re.findall(r"tandem:[A-Za-z0-9_:]+(\{[^}]*\})?", target["expr"])
                assert selectors and all('job=~"$job"' in s for s in selectors), target["expr"]
