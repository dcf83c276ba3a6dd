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
