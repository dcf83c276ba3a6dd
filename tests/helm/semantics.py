"""Checks on a rendered chart that no schema expresses: they tie the Serve side (what tandem's
own app builder asks of Ray for each deployment) to the Kubernetes side (what the RayService's
worker groups offer). Each check returns the problems it found (empty: consistent).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from unittest import mock

from ray.serve import Application

import tandem.deploy.app_builder as app_builder
from tests.helm.chart import Manifest, serve_config, the

MAX_NAME = 47
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


@dataclass(frozen=True)
class ServeDeployment:
    """One deployment of the built application, after the Serve config's overrides."""

    name: str
    ray_actor_options: dict[str, Any]
    max_replicas: int


@dataclass(frozen=True)
class Group:
    """What one Ray node group offers (per pod) and its pod bounds."""

    name: str
    cpus: float
    gpus: float
    resources: dict[str, float]
    container: dict[str, Any]
    replicas: int = 0
    min_replicas: int = 0
    max_replicas: int = 0


def build_deployments(config: dict[str, Any]) -> list[ServeDeployment]:
    """Builds the app with tandem's own builder (the checkpoint is not read: the pods mount it)
    and applies the application's `deployments:` overrides, as Serve does."""
    (app_config,) = config["applications"]
    with mock.patch.object(app_builder, "resolve_model", lambda cfg: cfg.model):
        app = app_builder.app_builder(app_config["args"])
    overrides = {d["name"]: d for d in app_config.get("deployments", [])}
    found: list[ServeDeployment] = []
    pending: list[Application] = [app]
    while pending:
        deployment = pending.pop()._bound_deployment
        pending += [a for a in deployment.init_args if isinstance(a, Application)]
        options = dict(deployment.ray_actor_options or {})
        options = overrides.get(deployment.name, {}).get("ray_actor_options", options)
        scaling = deployment._deployment_config.autoscaling_config
        top = scaling.max_replicas if scaling is not None else deployment.num_replicas
        found.append(ServeDeployment(deployment.name, options, int(top)))
    unknown = set(overrides) - {d.name for d in found}
    assert not unknown, f"serveConfigV2 overrides deployments the app does not have: {unknown}"
    return found


def _resources_param(text: str) -> dict[str, float]:
    loaded = json.loads(text.strip().strip("'\""))
    assert isinstance(loaded, dict)
    return {k: float(v) for k, v in loaded.items()}


def _group(name: str, spec: dict[str, Any]) -> Group:
    params = spec.get("rayStartParams", {})
    container = spec["template"]["spec"]["containers"][0]
    return Group(
        name=name,
        cpus=float(params.get("num-cpus", "0")),
        gpus=float(params.get("num-gpus", "0")),
        resources=_resources_param(params["resources"]) if "resources" in params else {},
        container=container,
        replicas=int(spec.get("replicas", 0)),
        min_replicas=int(spec.get("minReplicas", 0)),
        max_replicas=int(spec.get("maxReplicas", 0)),
    )


def groups(manifests: list[Manifest]) -> tuple[Group, list[Group]]:
    cluster = the(manifests, "RayService")["spec"]["rayClusterConfig"]
    head = _group("head", cluster["headGroupSpec"])
    return head, [_group(g["groupName"], g) for g in cluster["workerGroupSpecs"]]


def check_name(manifests: list[Manifest]) -> list[str]:
    name = the(manifests, "RayService")["metadata"]["name"]
    problems = []
    if len(name) > MAX_NAME:
        problems.append(f"RayService name {name!r} is {len(name)} characters (max {MAX_NAME})")
    if not DNS_1035.match(name):
        problems.append(f"RayService name {name!r} is not a DNS-1035 label")
    return problems


def check_bounds(manifests: list[Manifest]) -> list[str]:
    _, workers = groups(manifests)
    return [
        f"group {g.name}: minReplicas {g.min_replicas} <= replicas {g.replicas} <= "
        f"maxReplicas {g.max_replicas} does not hold"
        for g in workers
        if not g.min_replicas <= g.replicas <= g.max_replicas
    ]


def _gpu_limit(group: Group) -> float:
    limits = group.container.get("resources", {}).get("limits", {})
    requests = group.container.get("resources", {}).get("requests", {})
    total = 0.0
    for key in GPU_RESOURCES:
        if limits.get(key, 0) != requests.get(key, limits.get(key, 0)):
            raise ValueError(f"group {group.name}: {key} request != limit")
        total += float(limits.get(key, 0))
    return total


def check_gpus(manifests: list[Manifest], deployments: list[ServeDeployment]) -> list[str]:
    """Each group's Ray GPUs are its containers' GPUs; a GPU replica fits a GPU group; an engine
    on CUDA has a GPU."""
    head, workers = groups(manifests)
    problems = []
    for g in [head, *workers]:
        try:
            limit = _gpu_limit(g)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if limit != g.gpus or not float(g.gpus).is_integer():
            problems.append(f"group {g.name}: Ray num-gpus {g.gpus} but containers get {limit}")
    args = serve_config(manifests)["applications"][0]["args"]
    for d in deployments:
        if d.name in ("prefill", "decode"):
            engine = {**args.get("engine", {}), **args.get(d.name, {}).get("engine", {})}
            wants_cuda = str(engine.get("device", "cpu")).startswith("cuda")
            if wants_cuda and not d.ray_actor_options.get("num_gpus"):
                problems.append(f"deployment {d.name}: engine on {engine['device']} but no GPU")
    return problems


def check_placement(manifests: list[Manifest], deployments: list[ServeDeployment]) -> list[str]:
    """No replica can land on the head; every custom resource a deployment asks for is offered
    by a worker group whose pods fit a replica, and enough of them for its most replicas."""
    head, workers = groups(manifests)
    problems = []
    if head.cpus != 0 or head.resources:
        problems.append(f"the head offers num-cpus {head.cpus} / {head.resources}: replicas fit")
    for d in deployments:
        wanted = d.ray_actor_options.get("resources", {})
        if not wanted:
            problems.append(f"deployment {d.name} asks for no custom resource: not pinned")
        for resource, amount in wanted.items():
            offering = [g for g in workers if g.resources.get(resource, 0) >= amount]
            if not offering:
                problems.append(f"deployment {d.name} asks for {resource}={amount}: no group")
                continue
            for g in offering:
                per_pod = int(g.resources[resource] // amount)
                if d.ray_actor_options.get("num_cpus", 1) * per_pod > g.cpus:
                    problems.append(f"group {g.name}: {per_pod} x {d.name} need more CPUs")
                if d.ray_actor_options.get("num_gpus", 0) * per_pod > g.gpus:
                    problems.append(f"group {g.name}: {per_pod} x {d.name} need more GPUs")
            capacity = sum(int(g.resources[resource] // amount) * g.max_replicas for g in offering)
            if capacity < d.max_replicas:
                problems.append(
                    f"deployment {d.name} scales to {d.max_replicas} replicas; its groups hold "
                    f"{capacity}"
                )
    return problems


def _pod_labels_and_ports(manifests: list[Manifest]) -> list[tuple[dict[str, str], set[str]]]:
    cluster = the(manifests, "RayService")["spec"]["rayClusterConfig"]
    specs = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [
        (
            s["template"]["metadata"]["labels"],
            {p["name"] for c in s["template"]["spec"]["containers"] for p in c.get("ports", [])},
        )
        for s in specs
    ]


def check_selectors(manifests: list[Manifest]) -> list[str]:
    """Every Service and PodMonitor selects some Ray pods, and those pods name its port."""
    pods = _pod_labels_and_ports(manifests)
    problems = []
    for m in manifests:
        if m["kind"] == "Service":
            selector, ports = m["spec"]["selector"], [p["targetPort"] for p in m["spec"]["ports"]]
        elif m["kind"] == "PodMonitor":
            selector = m["spec"]["selector"]["matchLabels"]
            ports = [e["port"] for e in m["spec"]["podMetricsEndpoints"]]
        else:
            continue
        chosen = [names for labels, names in pods if selector.items() <= labels.items()]
        where = f"{m['kind']} {m['metadata']['name']}"
        if not chosen:
            problems.append(f"{where} selects no Ray pod")
        problems += [
            f"{where}: a selected pod has no port {p!r}"
            for p in ports
            for names in chosen
            if p not in names
        ]
    return problems


def check_serve_ports(manifests: list[Manifest]) -> list[str]:
    """Every Ray pod names the Serve proxy's port `serve`: proxy_location EveryNode runs a proxy
    on each pod that hosts a replica, and KubeRay's readiness probe of a RayService worker checks
    /-/healthz on the container port named serve (8000 when there is none)."""
    port = int(serve_config(manifests)["http_options"]["port"])
    cluster = the(manifests, "RayService")["spec"]["rayClusterConfig"]
    problems = []
    for spec in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        name = spec.get("groupName", "head")
        container = spec["template"]["spec"]["containers"][0]
        serve = [p for p in container.get("ports", []) if p.get("name") == "serve"]
        if [p["containerPort"] for p in serve] != [port]:
            problems.append(f"group {name}: container port 'serve' is {serve}, not {port}")
    return problems


def check_services_select_routers(manifests: list[Manifest]) -> list[str]:
    """The chart's Services front the router replicas only: they select router pods (by the
    component label), never a prefill or decode pod, though those name a `serve` port too."""
    cluster = the(manifests, "RayService")["spec"]["rayClusterConfig"]
    specs = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    problems = []
    for m in manifests:
        if m["kind"] != "Service":
            continue
        selector = m["spec"]["selector"]
        for spec in specs:
            labels = spec["template"]["metadata"]["labels"]
            if selector.items() <= labels.items() and spec.get("groupName") != "router":
                group = spec.get("groupName", "head")
                problems.append(f"Service {m['metadata']['name']} selects the {group} pods")
    return problems


def check_all(manifests: list[Manifest], deployments: list[ServeDeployment]) -> list[str]:
    return [
        *check_name(manifests),
        *check_bounds(manifests),
        *check_gpus(manifests, deployments),
        *check_placement(manifests, deployments),
        *check_selectors(manifests),
        *check_serve_ports(manifests),
        *check_services_select_routers(manifests),
    ]
