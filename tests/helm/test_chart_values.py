"""Values given on the command line reach what they configure (renders with `--set`)."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from tests.helm.chart import CHART, Manifest, run_helm, template_args, the
from tests.helm.semantics import check_serve_ports, check_services_select_routers


def _render(*sets: str) -> list[Manifest]:
    done = run_helm(*template_args(None), *sets)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_ports_dashboard_is_the_port_ray_serves_its_dashboard_on() -> None:
    # KubeRay deploys serveConfigV2 through the head container's port named `dashboard`: Ray's
    # dashboard listens there (another port is refused: KubeRay's probes check 8265 only)
    head = the(_render(), "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert (ports["dashboard"], head["rayStartParams"]["dashboard-port"]) == (8265, "8265")


def test_dashboards_without_extra_labels_render() -> None:
    # `labels: null` (Helm's way to drop the default grafana_dashboard label) broke the YAML
    maps = [
        m for m in _render("--set", "monitoring.dashboards.labels=null") if m["kind"] == "ConfigMap"
    ]
    assert len(maps) == 4
    assert sorted(maps[0]["metadata"]["labels"]) == [
        "app.kubernetes.io/instance",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/name",
        "app.kubernetes.io/version",
        "helm.sh/chart",
    ]


def _groups(manifests: list[Manifest]) -> dict[str, dict[str, Any]]:
    cluster = the(manifests, "RayService")["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]} | {
        g["groupName"]: g for g in cluster["workerGroupSpecs"]
    }


def test_every_pod_names_the_serve_port_at_ports_http() -> None:
    # KubeRay's readiness probe of a RayService worker checks /-/healthz on the container port
    # named serve (8000 when none is): prefill and decode pods, which run a Serve proxy too
    # (proxy_location EveryNode), stayed NotReady with ports.http 9000
    manifests = _render("--set", "ports.http=9000")
    for name, group in _groups(manifests).items():
        ports = group["template"]["spec"]["containers"][0]["ports"]
        assert [p["containerPort"] for p in ports if p["name"] == "serve"] == [9000], name
    assert check_serve_ports(manifests) == []
    assert check_services_select_routers(manifests) == []


def test_extra_ray_resources_join_the_group_resource() -> None:
    # a resource given through rayStartParams replaced the group's own (`prefill`), so no pod
    # advertised what the replicas ask for: extraRayResources adds to it instead
    manifests = _render(
        "--set",
        "prefill.extraRayResources.extra=4",
        "--set-string",
        "prefill.rayStartParams.object-store-memory=1000000000",
    )
    params = _groups(manifests)["prefill"]["rayStartParams"]
    assert json.loads(params["resources"].strip("'")) == {"extra": 4, "prefill": 1}
    assert params["object-store-memory"] == "1000000000"  # other parameters still pass through
    assert (params["num-cpus"], params["metrics-export-port"]) == ("4", "8080")
    assert json.loads(_groups(manifests)["decode"]["rayStartParams"]["resources"].strip("'")) == {
        "decode": 1
    }


def test_pod_cpu_is_documented_as_whole_cpus() -> None:
    # `cpu: 1500m` or `2.5` is refused by the schema (Ray's num-cpus is an integer): values.yaml
    # and the schema say so next to each group's cpu
    lines = (CHART / "values.yaml").read_text().splitlines()
    cpu_lines = [line for line in lines if re.match(r"^  cpu: ", line)]
    assert len(cpu_lines) == 4
    assert all("integer" in line.partition("#")[2] for line in cpu_lines), cpu_lines
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    for group in ("head", "router", "prefill", "decode"):
        cpu = schema[group]["properties"]["cpu"]
        assert cpu["type"] == "integer" and "Whole CPUs" in cpu["description"], group
