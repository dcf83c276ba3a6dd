"""Golden renders (TANDEM_UPDATE_GOLDEN=1 rewrites tests/helm/golden/), the dashboards as
ConfigMaps, and NOTES.txt."""

from __future__ import annotations

import difflib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import CHART, RELEASE, Manifest, ci_values_files, run_helm

GOLDEN = Path(__file__).parent / "golden"
DASHBOARDS = CHART.parents[1] / "deploy" / "dashboards"
RENDERS = list(ci_values_files())


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as `|` blocks, so golden diffs read line by line."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def _without_dashboards(manifests: list[Manifest]) -> list[Manifest]:
    """Dashboard JSON is deploy/dashboards' (checked below); goldens name the file instead, so
    regenerating the dashboards does not touch them."""
    out = []
    for m in manifests:
        if m["kind"] == "ConfigMap" and "grafana_dashboard" in m["metadata"]["labels"]:
            m = {**m, "data": {k: f"<deploy/dashboards/{k}>" for k in m["data"]}}
        out.append(m)
    return out


def golden_text(manifests: list[Manifest]) -> str:
    docs: list[Any] = _without_dashboards(manifests)
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=100)


@pytest.mark.parametrize("name", RENDERS)
def test_render_matches_its_golden(renders: dict[str, list[Manifest]], name: str) -> None:
    path = GOLDEN / f"{name}.yaml"
    text = golden_text(renders[name])
    if os.environ.get("TANDEM_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no golden {path}: run with TANDEM_UPDATE_GOLDEN=1"
    want = path.read_text()
    diff = "".join(
        difflib.unified_diff(want.splitlines(True), text.splitlines(True), "golden", name)
    )
    assert text == want, f"render differs from {path} (TANDEM_UPDATE_GOLDEN=1 rewrites):\n{diff}"


def test_no_stale_goldens() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.yaml")) == sorted(RENDERS)


def test_every_dashboard_is_a_labelled_configmap(renders: dict[str, list[Manifest]]) -> None:
    maps = {
        key: (m["metadata"]["labels"], value)
        for m in renders["default"]
        if m["kind"] == "ConfigMap"
        for key, value in m["data"].items()
    }
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files and sorted(maps) == [f.name for f in files]
    for f in files:
        labels, text = maps[f.name]
        assert labels["grafana_dashboard"] == "1"
        assert text == f.read_text().rstrip("\n")


@pytest.mark.parametrize("name", ["default", "monitoring", "colocated"])
def test_notes_render(tmp_path: Path, name: str) -> None:
    """helm template skips NOTES.txt: render it as a template of a copy of the chart."""
    chart = tmp_path / "tandem"
    shutil.copytree(CHART, chart, symlinks=False, ignore=shutil.ignore_patterns("*.py", "ci"))
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "notes" -}}\n' + notes + "\n{{- end -}}\n"
    )
    (chart / "templates" / "notes.yaml").write_text(
        'kind: Notes\ntext: {{ include "notes" . | toJson }}\n'
    )
    values = ci_values_files()[name]
    args = ["template", RELEASE, str(chart), "--show-only", "templates/notes.yaml"]
    args += ["-f", str(values)] if values else []
    done = run_helm(*args)
    assert done.returncode == 0, done.stderr
    text = yaml.safe_load(done.stdout)["text"]
    assert "port-forward svc/tandem-openai 8000:8000" in text
    assert '"model": "model"' in text
    assert ("prefill" in text) == (name != "colocated")
