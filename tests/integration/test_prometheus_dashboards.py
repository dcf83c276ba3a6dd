"""A real Prometheus scrapes a running cluster; every dashboard panel's PromQL returns data.

`prometheus` (Debian's package; `scripts/install_prometheus.sh`) must be on PATH: this test
fails rather than skips without it. With `TANDEM_OBSERVABILITY_PLOTS=DIR` it also plots the main
panels' series into DIR (the figures of docs/observability.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tandem.deploy.dashboards.build import scoped
from tandem.deploy.dashboards.panels import DASHBOARDS
from tests.integration.conftest import free_port

pytestmark = pytest.mark.ray
DEPLOYMENT = "1x1"  # (conftest groups the tests by deployment)

SCRAPE_S = 1


@pytest.fixture()
def prometheus(cluster: Any, tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "no `prometheus` on PATH: run scripts/install_prometheus.sh"
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: {SCRAPE_S}s, evaluation_interval: {SCRAPE_S}s}}\n"
        "scrape_configs:\n"
        "  - job_name: tandem\n"
        "    metrics_path: /metrics\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{cluster.http_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def send_traffic(base: str, seconds: float) -> None:
    """Completions and streams with shared prefixes, one agent-like user coming back, one
    refusal (429) and one unknown model (404), spread over `seconds` so rates have points."""
    shared = list(range(20, 68))  # 48 tokens: 3 full blocks, reused
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end or i < 6:
        body: dict[str, Any] = {
            "model": "tiny", "prompt": shared + [100 + i, 7, 8], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "user": "agent-1",
        }  # fmt: skip
        if i % 2:
            body.update(stream=True, stream_options={"include_usage": True})
        resp = requests.post(f"{base}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        if i == 2:
            assert (
                requests.post(
                    f"{base}/v1/completions",
                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "deadline_ms": 0.001},
                    timeout=30,
                ).status_code
                == 429
            )
            assert (
                requests.post(
                    f"{base}/v1/completions", json={"model": "none", "prompt": "x"}, timeout=30
                ).status_code
                == 404
            )
        i += 1
        time.sleep(0.2)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    resp = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert body.get("status") == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_every_dashboard_expression_returns_data(cluster: Any, prometheus: str) -> None:
    base = cluster.deploy_pd(1)
    started = time.time()
    send_traffic(base, seconds=8)
    time.sleep(3 * SCRAPE_S)  # the last requests' counters scraped
    # As Grafana sends them: each series limited to the `job` variable's choice, here the job
    # its own query offers (this Prometheus scrapes one, "tandem").
    jobs = query(prometheus, "count by (job) (tandem:role_replicas)")
    assert [j["metric"]["job"] for j in jobs] == ["tandem"]
    exprs = [
        (board.title, panel.title, scoped(q.expr).replace("$job", "tandem"))
        for board in DASHBOARDS
        for panel in board.panels
        for q in panel.queries
    ]
    assert len(exprs) >= 30
    empty = [e for e in exprs if not query(prometheus, e[2])]
    if empty:  # one more scrape round before failing (a slow machine)
        time.sleep(5 * SCRAPE_S)
        empty = [e for e in empty if not query(prometheus, e[2])]
    assert not empty, "dashboard expressions without data:\n" + "\n".join(map(str, empty))
    other = [e for e in exprs if query(prometheus, e[2].replace('"tandem"', '"other-release"'))]
    assert not other, "expressions not limited to the chosen job:\n" + "\n".join(map(str, other))
    out = os.environ.get("TANDEM_OBSERVABILITY_PLOTS")
    if out:
        plot_main_panels(prometheus, Path(out), started, time.time())


def plot_main_panels(url: str, out: Path, start: float, end: float) -> None:
    """PNG per main panel: each query's series over the run (query_range, 1 s steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    wanted = {
        "Time to first token", "Inter-token latency", "Tokens / s", "Goodput and SLO attainment",
        "KV-cache usage", "Prefix-cache hit rate", "KV transfer throughput",
        "Request stages (median)",
    }  # fmt: skip
    for board in DASHBOARDS:
        for panel in board.panels:
            if panel.title not in wanted:
                continue
            fig, ax = plt.subplots(figsize=(6, 3))
            for q in panel.queries:
                params = {"query": q.expr, "start": start, "end": end, "step": 1}
                data = requests.get(f"{url}/api/v1/query_range", params=params, timeout=10).json()
                for series in data["data"]["result"]:
                    times = [float(t) - start for t, _ in series["values"]]
                    values = [float(v) for _, v in series["values"]]
                    label = q.legend
                    for key, val in series["metric"].items():
                        label = label.replace("{{" + key + "}}", val)
                    ax.plot(times, values, label=label)
            ax.set_title(f"{panel.title} ({panel.unit})")
            ax.set_xlabel("seconds into the run")
            ax.legend(fontsize=7)
            fig.tight_layout()
            name = panel.title.lower().replace(" / ", "-").replace(" ", "-").replace("(", "")
            fig.savefig(out / f"{name.replace(')', '')}.png", dpi=80)
            plt.close(fig)
