"""Build the Grafana dashboards with grafana-foundation-sdk and write them as JSON.

    .venv/bin/python -m tandem.deploy.dashboards.build [--out deploy/dashboards] [--check]

``--check`` exits 1 when a written file differs from what this code builds (CI runs it through
the tests). Panels come from `panels.py`; the Prometheus datasource is the template variable
``${datasource}``, so the JSON imports into any Grafana.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tandem.deploy.dashboards.panels import DASHBOARDS, Dashboard

HERE = Path(__file__).resolve().parent


def build(spec: Dashboard) -> dict[str, Any]:
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

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
                .expr(query.expr)
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
