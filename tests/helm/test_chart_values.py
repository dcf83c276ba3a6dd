"""Values given on the command line reach what they configure (renders with `--set`)."""

from __future__ import annotations

import yaml

from tests.helm.chart import Manifest, run_helm, template_args, the


def _render(*sets: str) -> list[Manifest]:
    done = run_helm(*template_args(None), *sets)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_ports_dashboard_is_the_port_ray_serves_its_dashboard_on() -> None:
    # KubeRay deploys serveConfigV2 through the head container's port named `dashboard`: Ray's
    # dashboard must listen there (it stayed on 8265 while the port said 9265)
    head = the(_render("--set", "ports.dashboard=9265"), "RayService")["spec"]["rayClusterConfig"][
        "headGroupSpec"
    ]
    ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert (ports["dashboard"], head["rayStartParams"]["dashboard-port"]) == (9265, "9265")


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
