"""Build the Grafana dashboards with grafana-foundation-sdk and write them as JSON.

    .venv/bin/python -m tandem.deploy.dashboards.build [--out deploy/dashboards] [--check]

``--check`` exits 1 when a written file differs from what this code builds (CI runs it through
the tests). Panels come from `panels.py`; the Prometheus datasource is the template variable
``${datasource}``, so the JSON imports into any Grafana. A second variable, ``job``, picks the
scrape jobs shown (all by default): the chart's PodMonitors name theirs
``<namespace>/<release>-tandem-router``, so two releases in one Prometheus stay apart.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from tandem.deploy.dashboards.panels import DASHBOARDS, Dashboard

HERE = Path(__file__).resolve().parent
JOB_MATCHER = 'job=~"$job"'
_SELECTOR = re.compile(r"(tandem:[A-Za-z0-9_:]+)(\{([^}]*)\})?")


def scoped(expr: str) -> str:
    """`expr` with every tandem series limited to the dashboard's ``$job`` selection."""

    def add(hit: re.Match[str]) -> str:
        inner = hit.group(3)
        return f"{hit.group(1)}{{{inner + ', ' if inner else ''}{JOB_MATCHER}}}"

    return _SELECTOR.sub(add, expr)


def build(spec: Dashboard) -> dict[str, Any]:
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import (
        DataSourceRef,
        VariableOption,
        VariableRefresh,
    )

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        dashboard.Dashboard(spec.title)
        .uid(spec.uid)
        .tags(["tandem"])
        .refresh("10s")
        .time("now-30m", "now")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("job")
            .label("Job")
            .datasource(source)
            .query("label_values(tandem:role_replicas, job)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
        )
    )
    for panel in spec.panels:
        ts = (
            timeseries.Panel()
            .title(panel.title)
            .description(panel.description)
            .unit(panel.unit)
            .datasource(source)
            .height(8)
            .span(12)
        )
        for j, query in enumerate(panel.queries):
            ts = ts.with_target(
                prometheus.Dataquery()
                .expr(scoped(query.expr))
                .legend_format(query.legend)
                .ref_id(chr(ord("A") + j))
            )
        board = board.with_panel(ts)
    encoded: dict[str, Any] = json.loads(
        JSONEncoder(sort_keys=True, indent=2).encode(board.build())
    )
    return encoded


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        f"{spec.uid.removeprefix('tandem-')}.json": json.dumps(
            build(spec), indent=2, sort_keys=True
        )
        + "\n"
        for spec in DASHBOARDS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="directory for the JSON files")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a diff")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (rebuild them): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
