"""Every values file under helm/tandem/ci/negative/ makes the render fail with the message its
`# expect:` line names. `helm lint` does not pass them quietly either: it fails, or (a template
`fail` is only an [INFO] line in lint mode, by Helm's design) it prints the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helm.chart import CHART, header, negative_values_files, run_helm, template_args

CASES = negative_values_files()


def test_the_acceptance_cases_are_there() -> None:
    names = {p.stem for p in CASES}
    assert {"autoscaling-min-above-max", "missing-model-path", "unknown-transport"} <= names


def test_the_chart_owned_ray_start_params_are_refused() -> None:
    names = {p.stem for p in CASES}
    assert {
        "ray-start-params-resources",
        "ray-start-params-num-cpus",
        "ray-start-params-num-gpus",
        "ray-start-params-metrics-port",
        "head-ray-start-params-dashboard-port",
        "extra-ray-resources-role-resource",
        "extra-ray-resources-predefined",
        "cpu-not-integer",
    } <= names


@pytest.mark.parametrize("values", CASES, ids=[p.stem for p in CASES])
def test_negative_values_fail_with_their_message(values: Path) -> None:
    expected = header(values, "expect")
    assert expected, f"{values.name}: no '# expect:' line"
    done = run_helm(*template_args(values))
    assert done.returncode != 0, f"{values.name} rendered"
    assert expected in done.stderr, done.stderr
    linted = run_helm("lint", "--strict", str(CHART), "-f", str(values))
    assert linted.returncode != 0 or expected in linted.stdout + linted.stderr
