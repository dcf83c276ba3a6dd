"""The cluster config's cross-field rules hold at render time too (`tandem.validateConfigRules`
in templates/_validate.tpl mirrors ClusterConfig._devices_fit_the_roles and
RoleAutoscaling._consistent): values they refuse failed only when KubeRay deployed the app.

Each negative values file with a `# config-error:` line is refused by the chart (its `# expect:`,
test_chart_negative.py) and, rendered by a copy of the chart without those checks, by
ClusterConfig with that message; values just on the right side of each rule render and load.
"""

from __future__ import annotations

import re
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from tandem.deploy.autoscaling_config import DecodeAutoscaling, PrefillAutoscaling
from tandem.deploy.cluster_config import ClusterConfig
from tests.helm.chart import (
    CHART,
    header,
    negative_values_files,
    run_helm,
    serve_config,
    template_args,
)

RULES_CALL = '{{- include "tandem.validateConfigRules" . -}}'
IMAGE_CALL = '{{- include "tandem.validateImage" . -}}'  # (the chart's own: not the config's)
CASES = [p for p in negative_values_files() if header(p, "config-error")]


@pytest.fixture(scope="module")
def unchecked_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart whose render skips the cross-field checks (and only those)."""
    chart = tmp_path_factory.mktemp("unchecked") / "tandem"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("ci"))
    validate = chart / "templates" / "_validate.tpl"
    text = validate.read_text()
    assert text.count(RULES_CALL) == 1, "tandem.validate no longer calls the rules once"
    validate.write_text(text.replace(RULES_CALL, "").replace(IMAGE_CALL, ""))
    return chart


def _args(values: Path, chart: Path = CHART) -> dict[str, Any]:
    """The cluster config args the chart renders into serveConfigV2 with `values`."""
    done = run_helm(*template_args(values, chart))
    assert done.returncode == 0, done.stderr
    config = serve_config([doc for doc in yaml.safe_load_all(done.stdout) if doc])
    args = config["applications"][0]["args"]
    assert isinstance(args, dict)
    return args


def _values_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_each_rule_has_a_case() -> None:
    assert {p.stem for p in CASES} >= {
        "cuda-without-gpus",
        "role-cuda-without-gpus",
        "ucx-on-gpu",
        "autoscaling-look-back-not-above-interval",
        "autoscaling-every-target-null",
    }


@pytest.mark.parametrize("values", CASES, ids=[p.stem for p in CASES])
def test_the_cluster_config_refuses_what_the_chart_refuses(
    values: Path, unchecked_chart: Path
) -> None:
    args = _args(values, unchecked_chart)
    with pytest.raises(ValidationError, match=re.escape(header(values, "config-error"))):
        ClusterConfig.model_validate(args)


ACCEPTED: dict[str, dict[str, Any]] = {
    "cuda-with-gpus": {
        "image": {"variant": "cuda"},
        "serve": {"engine": {"device": "cuda"}},
        "prefill": {"numGpus": 1},
        "decode": {"numGpus": 0.5, "replicasPerPod": 2, "cpu": 8},
    },
    "role-cuda-index-with-a-gpu": {
        "image": {"variant": "cuda"},
        "decode": {"engine": {"device": "cuda:1"}, "numGpus": 1},
    },
    "role-cpu-under-shared-cuda": {
        "image": {"variant": "cuda"},
        "serve": {"engine": {"device": "cuda"}},
        "prefill": {"numGpus": 1},
        "decode": {"engine": {"device": "cpu"}},
    },
    "colocated-has-no-prefill-role": {
        "image": {"variant": "cuda"},
        "serve": {"mode": "colocated", "engine": {"device": "cuda"}},
        "decode": {"numGpus": 1},
    },
    "ucx-on-cpu-beside-a-gpu": {
        "serve": {"transport": "ucx", "engine": {"device": "cpu"}},
        "decode": {"numGpus": 1},
    },
    "ucx-colocated-on-a-gpu": {
        "image": {"variant": "cuda"},
        "serve": {"mode": "colocated", "transport": "ucx"},
        "decode": {"numGpus": 1},
    },
    "look-back-just-above-the-default-interval": {
        "decode": {"autoscaling": {"enabled": True, "look_back_period_s": 2.5}}
    },
    "interval-just-below-the-default-look-back": {
        "prefill": {"autoscaling": {"enabled": True, "metrics_interval_s": 9.5}}
    },
    "one-target-left": {
        "decode": {
            "autoscaling": {
                "enabled": True,
                "kv_usage_target": None,
                "running_seqs_per_replica": None,
            }
        }
    },
    "null-targets-while-autoscaling-is-off": {
        "prefill": {
            "autoscaling": {
                "queued_prefill_tokens_per_replica": None,
                "ttft_target_ms": None,
            }
        }
    },
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_values_on_the_right_side_of_each_rule_render_and_load(tmp_path: Path, name: str) -> None:
    ClusterConfig.model_validate(_args(_values_file(tmp_path, ACCEPTED[name])))


def _targets(model: type[BaseModel]) -> list[str]:
    """The scaling targets: the fields that may be null (null turns the target off)."""
    return [
        name
        for name, field in model.model_fields.items()
        if type(None) in typing.get_args(field.annotation)
    ]


@pytest.mark.parametrize(
    ("role", "model"), [("prefill", PrefillAutoscaling), ("decode", DecodeAutoscaling)]
)
def test_every_target_of_the_model_keeps_autoscaling_valid(
    tmp_path: Path, role: str, model: type[BaseModel]
) -> None:
    """The chart's target lists are the models': all null is refused, any one left is not."""
    targets = _targets(model)
    assert len(targets) >= 2
    off = {"enabled": True, **dict.fromkeys(targets)}
    done = run_helm(*template_args(_values_file(tmp_path, {role: {"autoscaling": off}})))
    assert done.returncode != 0
    assert f"{role}.autoscaling: every scaling target is null" in done.stderr
    for kept in targets:
        block = {**off, kept: model.model_fields[kept].default}
        ClusterConfig.model_validate(_args(_values_file(tmp_path, {role: {"autoscaling": block}})))
