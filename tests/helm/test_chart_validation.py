"""The chart renders valid objects: `helm lint --strict`, core kinds (and the Ray pod templates)
against Kubernetes' schemas, the RayService against the project schema, serveConfigV2 against
Ray Serve's schema and tandem's cluster config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from tandem.deploy.cluster_config import ClusterConfig
from tests.helm.chart import CHART, Manifest, ci_values_files, run_helm, serve_config, the

KUBERNETES = "1.30.0"
CORE_KINDS = {"Service", "ConfigMap", "Secret"}
RENDERS = list(ci_values_files())
RAYSERVICE_SCHEMA = json.loads((Path(__file__).parent / "rayservice.schema.json").read_text())


def test_helm_lint_strict_passes_with_every_values_file() -> None:
    for name, values in ci_values_files().items():
        args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
        done = run_helm(*args)
        assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr}"
        assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("name", RENDERS)
def test_only_known_kinds_are_rendered(renders: dict[str, list[Manifest]], name: str) -> None:
    kinds = {m["kind"] for m in renders[name]}
    assert kinds <= CORE_KINDS | {"RayService", "PodMonitor"}
    assert {"RayService", "Service", "ConfigMap"} <= kinds


@pytest.mark.parametrize("name", RENDERS)
def test_core_kinds_validate_strictly(renders: dict[str, list[Manifest]], name: str) -> None:
    checked = 0
    for manifest in renders[name]:
        if manifest["kind"] in CORE_KINDS:
            kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
            checked += 1
    assert checked >= 2


def test_the_kubernetes_validate_command_accepts_the_core_kinds(
    renders: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """The CLI too (as CI scripts call it), on every render's core kinds in one file."""
    core = [m for ms in renders.values() for m in ms if m["kind"] in CORE_KINDS]
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    cli = Path(sys.executable).parent / "kubernetes-validate"
    done = subprocess.run(
        [str(cli), "-k", KUBERNETES, "--strict", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("INFO") == len(core)


@pytest.mark.parametrize("name", RENDERS)
def test_ray_pod_templates_validate_as_pod_templates(
    renders: dict[str, list[Manifest]], name: str
) -> None:
    cluster = the(renders[name], "RayService")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": group.get("groupName", "head")},
            "template": group["template"],
        }
        kubernetes_validate.validate(pod_template, KUBERNETES, strict=True)


@pytest.mark.parametrize("name", RENDERS)
def test_rayservice_matches_the_project_schema(
    renders: dict[str, list[Manifest]], name: str
) -> None:
    jsonschema.validate(the(renders[name], "RayService"), RAYSERVICE_SCHEMA)


def test_the_project_schema_refuses_what_kuberay_would() -> None:
    validator = jsonschema.Draft202012Validator(RAYSERVICE_SCHEMA)
    good = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "t"},
        "spec": {
            "serveConfigV2": "applications: []",
            "rayClusterConfig": {
                "rayVersion": "2.60.0",
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [{}]}}},
                "workerGroupSpecs": [
                    {
                        "groupName": "decode",
                        "replicas": 1,
                        "minReplicas": 0,
                        "maxReplicas": 2,
                        "rayStartParams": {"num-cpus": "2"},
                        "template": {"spec": {"containers": [{}]}},
                    }
                ],
            },
        },
    }
    assert validator.is_valid(good)
    worker = good["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]  # type: ignore[index]
    for field, bad in [("rayStartParams", {"num-cpus": 2}), ("replica", 1), ("groupName", "A")]:
        broken = json.loads(json.dumps(good))
        broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0] = {**worker, field: bad}
        assert not validator.is_valid(broken), field


@pytest.mark.parametrize("name", RENDERS)
def test_serve_config_loads_in_ray_serve_and_tandem(
    renders: dict[str, list[Manifest]], name: str
) -> None:
    config = serve_config(renders[name])
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "tandem.deploy.app_builder:app_builder"
    cluster = ClusterConfig.model_validate(app.args)
    assert cluster.host == "0.0.0.0"
    assert cluster.port == schema.http_options.port
    assert cluster.model is not None and cluster.model.startswith("/")


def test_every_deployment_override_names_a_deployment_of_the_app(
    deployments: dict[str, list[object]],
) -> None:
    # build_deployments refuses overrides of unknown deployments; here: the set is complete.
    for name, built in deployments.items():
        names = sorted(d.name for d in built)  # type: ignore[attr-defined]
        want = ["decode", "router"] if name == "colocated" else ["decode", "prefill", "router"]
        assert names == want, name
