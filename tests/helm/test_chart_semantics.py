"""Semantic checks hold on every render, and each check catches the break it is for."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tests.helm.chart import Manifest, ci_values_files, serve_config, the
from tests.helm.semantics import ServeDeployment, build_deployments, check_all, groups

RENDERS = list(ci_values_files())


@pytest.mark.parametrize("name", RENDERS)
def test_every_render_is_consistent(
    renders: dict[str, list[Manifest]],
    deployments: dict[str, list[ServeDeployment]],
    name: str,
) -> None:
    assert check_all(renders[name], deployments[name]) == []


def test_worker_groups_follow_the_serve_bounds(renders: dict[str, list[Manifest]]) -> None:
    _, workers = groups(renders["gpu"])
    by_name = {g.name: g for g in workers}
    prefill, decode = by_name["prefill"], by_name["decode"]
    # prefill: 1..8 replicas, one per pod; decode: 2..8 replicas, two per 2-GPU pod
    assert (prefill.min_replicas, prefill.replicas, prefill.max_replicas) == (1, 2, 8)
    assert (decode.min_replicas, decode.replicas, decode.max_replicas) == (1, 1, 4)
    assert (decode.gpus, decode.resources) == (2.0, {"decode": 2.0})
    args = serve_config(renders["gpu"])["applications"][0]["args"]
    assert args["decode"]["autoscaling"]["kv_usage_target"] == 0.8
    assert "enabled" not in args["decode"]["autoscaling"]


def test_the_head_runs_no_replica_and_autoscaler_v2_is_on(
    renders: dict[str, list[Manifest]],
) -> None:
    cluster = the(renders["default"], "RayService")["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["version"] == "v2"
    # KubeRay before 1.4 has no `version`: the head gets RAY_enable_autoscaler_v2 instead
    old = the(renders["hostpath"], "RayService")["spec"]["rayClusterConfig"]
    assert "version" not in old["autoscalerOptions"]
    env = old["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RAY_enable_autoscaler_v2", "value": "1"} in env


def test_the_model_is_mounted_read_only_on_every_pod(renders: dict[str, list[Manifest]]) -> None:
    for name in ("default", "hostpath"):
        cluster = the(renders[name], "RayService")["spec"]["rayClusterConfig"]
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
            spec = group["template"]["spec"]
            (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
            (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model"]
            assert mount["readOnly"] is True
            assert volume.get("persistentVolumeClaim", {"readOnly": True})["readOnly"] is True


def test_the_api_key_reaches_only_the_router_pods(renders: dict[str, list[Manifest]]) -> None:
    cluster = the(renders["monitoring"], "RayService")["spec"]["rayClusterConfig"]
    secret = the(renders["monitoring"], "Secret")
    for group in cluster["workerGroupSpecs"]:
        env = group["template"]["spec"]["containers"][0]["env"]
        keys = [e for e in env if e["name"] == "TANDEM_API_KEY"]
        if group["groupName"] == "router":
            ref = keys[0]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "api-key")
        else:
            assert keys == []
    assert not [m for m in renders["default"] if m["kind"] == "Secret"]


def test_the_haproxy_ingress_is_switched_on_for_every_pod(
    renders: dict[str, list[Manifest]],
) -> None:
    flag = {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"}
    for name, want in (("monitoring", True), ("default", False)):
        cluster = the(renders[name], "RayService")["spec"]["rayClusterConfig"]
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
            env = group["template"]["spec"]["containers"][0]["env"]
            assert (flag in env) is want, (name, group.get("groupName", "head"))


def test_pod_monitors_only_with_the_prometheus_operator(
    renders: dict[str, list[Manifest]],
) -> None:
    assert not [m for m in renders["default"] if m["kind"] == "PodMonitor"]
    monitors = [m for m in renders["monitoring"] if m["kind"] == "PodMonitor"]
    assert len(monitors) == 2
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)


def _break_bounds(m: list[Manifest]) -> None:
    the(m, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["minReplicas"] = 9


def _break_gpus(m: list[Manifest]) -> None:
    group = the(m, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][2]
    group["rayStartParams"]["num-gpus"] = "4"


def _drop_resource(m: list[Manifest]) -> None:
    group = the(m, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]
    group["rayStartParams"]["resources"] = "'{\"other\": 1}'"


def _cpus_on_head(m: list[Manifest]) -> None:
    the(m, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"][
        "num-cpus"
    ] = "4"


def _long_name(m: list[Manifest]) -> None:
    the(m, "RayService")["metadata"]["name"] = "t" * 48


def _shrink_group(m: list[Manifest]) -> None:
    the(m, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][2]["maxReplicas"] = 1


def _bad_port(m: list[Manifest]) -> None:
    service = next(x for x in m if x["kind"] == "Service")
    service["spec"]["ports"][0]["targetPort"] = "http-typo"


def _unnamed_serve_port(m: list[Manifest]) -> None:
    group = the(m, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]
    group["template"]["spec"]["containers"][0]["ports"] = [
        p for p in group["template"]["spec"]["containers"][0]["ports"] if p["name"] != "serve"
    ]


def _service_without_component(m: list[Manifest]) -> None:
    service = next(x for x in m if x["kind"] == "Service")
    del service["spec"]["selector"]["app.kubernetes.io/component"]


@pytest.mark.parametrize(
    ("render", "breaks", "message"),
    [
        ("default", _break_bounds, "minReplicas 9 <= replicas 1"),
        ("gpu", _break_gpus, "Ray num-gpus 4.0 but containers get 2.0"),
        ("default", _drop_resource, "asks for prefill=1"),
        ("default", _cpus_on_head, "the head offers num-cpus 4.0"),
        ("default", _long_name, "is 48 characters"),
        ("gpu", _shrink_group, "scales to 8 replicas; its groups hold 2"),
        ("colocated", _bad_port, "has no port 'http-typo'"),
        ("default", _unnamed_serve_port, "group prefill: container port 'serve' is [], not 8000"),
        ("default", _service_without_component, "Service tandem-openai selects the decode pods"),
    ],
)
def test_each_check_catches_its_break(
    renders: dict[str, list[Manifest]],
    deployments: dict[str, list[ServeDeployment]],
    render: str,
    breaks: Callable[[list[Manifest]], Any],
    message: str,
) -> None:
    broken = copy.deepcopy(renders[render])
    breaks(broken)
    problems = check_all(broken, deployments[render])
    assert any(message in p for p in problems), problems


def test_a_cuda_engine_without_gpus_is_caught(renders: dict[str, list[Manifest]]) -> None:
    """The cluster config itself refuses a CUDA engine that asks Ray for no GPU; a Serve
    `deployments:` override that takes the GPU away again is caught here."""
    config = copy.deepcopy(serve_config(renders["default"]))
    args = config["applications"][0]["args"]
    args["engine"]["device"] = "cuda"
    with pytest.raises(ValidationError, match="prefill runs on 'cuda' but asks Ray for no GPU"):
        build_deployments(config)
    for role in ("prefill", "decode"):
        args[role]["num_gpus"] = 1
    config["applications"][0]["deployments"] = [
        {"name": "prefill", "ray_actor_options": {"num_cpus": 1}}
    ]
    broken = copy.deepcopy(renders["default"])
    the(broken, "RayService")["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    problems = check_all(broken, build_deployments(config))
    assert "deployment prefill: engine on cuda but no GPU" in problems


def test_the_router_options_reach_the_cluster_config(renders: dict[str, list[Manifest]]) -> None:
    """serve.toolCallParser / reasoningParser / chatTemplate (ci/colocated-values.yaml) land
    in the cluster config's router section and `chat_template`; unset, tool calls are auto."""
    args = serve_config(renders["colocated"])["applications"][0]["args"]
    assert args["router"]["tool_call_parser"] == "hermes"
    assert args["router"]["reasoning_parser"] == "qwen3"
    assert args["chat_template"].startswith("{% for m in messages %}<|im_start|>")
    default = serve_config(renders["default"])["applications"][0]["args"]
    assert default["router"]["tool_call_parser"] == "auto" and "chat_template" not in default
    assert "reasoning_parser" not in default["router"]
