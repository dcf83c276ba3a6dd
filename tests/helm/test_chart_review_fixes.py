"""Values given with `--set` the way an operator types them: floats (Helm passes them as
strings), the in-tree autoscaler off, a checkpoint at the mount's root, ports Ray owns,
quantities; and what the chart derives from them (router grace period, Ray's object store)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tandem.deploy import helm_schema
from tandem.deploy.cluster_config import ClusterConfig
from tests.helm.chart import (
    CHART,
    Manifest,
    app_args,
    ray_groups,
    run_helm,
    serve_config,
    template_args,
)

GPU = (
    "--set",
    "serve.engine.device=cuda",
    "--set",
    "prefill.numGpus=1",
    "--set",
    "image.variant=cuda",
)


def _helm(*sets: str) -> Any:
    return run_helm(*template_args(None), *sets)


def _render(*sets: str) -> list[Manifest]:
    done = _helm(*sets)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _set(*assignments: str) -> list[str]:
    """`--set` before each of `assignments`."""
    return [arg for assignment in assignments for arg in ("--set", assignment)]


def _refused(*sets: str) -> str:
    done = _helm(*sets)
    assert done.returncode != 0, f"rendered with {sets}"
    return str(done.stderr)


# 1. Serve autoscaling without the in-tree autoscaler


def test_role_autoscaling_beyond_the_fixed_pods_needs_the_autoscaler() -> None:
    err = _refused(
        *_set(
            "autoscaler.enabled=false",
            "decode.autoscaling.enabled=true",
            "decode.autoscaling.max_replicas=6",
        ),
    )
    assert "autoscaler.enabled" in err and "decode.autoscaling.max_replicas (6)" in err, err


def test_role_autoscaling_within_the_fixed_pods_renders_without_the_autoscaler() -> None:
    # 2 pods of 3 replicas each host 6 replicas: no pod need ever be added
    manifests = _render(
        *_set(
            "autoscaler.enabled=false",
            "decode.autoscaling.enabled=true",
            "decode.autoscaling.max_replicas=6",
            "decode.replicas=4",
            "decode.replicasPerPod=3",
            "decode.cpu=6",
        ),
    )
    decode = ray_groups(manifests)["decode"]
    assert decode["replicas"] * 3 >= 6
    assert decode["minReplicas"] <= decode["replicas"] <= decode["maxReplicas"]
    # autoscaler on, the same values render as before
    _render(
        "--set", "decode.autoscaling.enabled=true", "--set", "decode.autoscaling.max_replicas=6"
    )


# 2. floats on the command line


def test_num_gpus_given_with_set_renders_as_a_number() -> None:
    manifests = _render(
        *GPU,
        *_set(
            "decode.numGpus=0.5",
            "decode.replicasPerPod=2",
            "decode.cpu=8",
        ),
    )
    args = app_args(manifests)
    assert args["decode"]["num_gpus"] == 0.5
    assert ray_groups(manifests)["decode"]["rayStartParams"]["num-gpus"] == "1"
    ClusterConfig.model_validate(args)


def test_engine_and_role_floats_given_with_set_render_as_numbers() -> None:
    manifests = _render(
        *_set(
            "serve.engine.gpu_memory_utilization=0.85",
            "decode.numCpus=1.5",
            "router.numCpus=0.5",
            "serve.routing.hit_weight=2.5",
            "decode.autoscaling.enabled=true",
            "decode.autoscaling.kv_usage_target=0.7",
            "prefill.drainTimeoutS=45.5",
            "serve.leaseS=12.5",
            "decode.extraRayResources.accel=0.5",
        )
    )
    args = app_args(manifests)
    assert args["engine"]["gpu_memory_utilization"] == 0.85
    assert args["decode"]["num_cpus"] == 1.5
    assert args["router"]["num_cpus"] == 0.5
    assert args["routing"]["hit_weight"] == 2.5
    assert args["decode"]["autoscaling"]["kv_usage_target"] == 0.7
    assert args["prefill"]["drain_timeout_s"] == 45.5
    assert args["lease_s"] == 12.5
    router = serve_config(manifests)["applications"][0]["deployments"][0]
    assert router["ray_actor_options"]["num_cpus"] == 0.5
    resources = ray_groups(manifests)["decode"]["rayStartParams"]["resources"]
    assert json.loads(resources.strip("'")) == {"accel": 0.5, "decode": 1}
    ClusterConfig.model_validate(args)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("serve.engine.gpu_memory_utilization=1.5", "serve.engine.gpu_memory_utilization"),
        ("serve.engine.gpu_memory_utilization=0", "serve.engine.gpu_memory_utilization"),
        ("decode.numGpus=-0.5", "decode.numGpus"),
        ("decode.numGpus=half", "decode.numGpus"),
        ("decode.autoscaling.kv_usage_target=1.01", "decode.autoscaling.kv_usage_target"),
        ("serve.routing.guard_max_share=1.0", "serve.routing.guard_max_share"),
        ("serve.admission.safety_factor=0.9", "serve.admission.safety_factor"),
    ],
)
def test_float_strings_out_of_range_are_refused(setting: str, message: str) -> None:
    assert message in _refused("--set", setting)


def _decimal_cases() -> list[str]:
    values = ["0", "0.0", "00.5", ".5", "5.", "0.0001", "0.999", "1", "1.0", "1.000", "1.5"]
    values += ["2", "10", "12.25", "+0.5", "+1.5", "-0.5", "-1", "1e3", "0x10", "", ".", "1.2.3"]
    return values


@pytest.mark.parametrize(
    "bounds",
    [
        {},
        {"minimum": 0},
        {"exclusiveMinimum": 0},
        {"minimum": 1.0},
        {"exclusiveMinimum": 1.0},
        {"exclusiveMinimum": 0, "maximum": 1},
        {"minimum": 0, "maximum": 1},
    ],
    ids=str,
)
def test_the_numeric_string_pattern_keeps_the_bounds(bounds: dict[str, float]) -> None:
    pattern = helm_schema.decimal_pattern(bounds)
    assert pattern is not None
    for text in _decimal_cases():
        try:
            value = float(text)
            plain = re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", text) is not None
        except ValueError:
            value, plain = 0.0, False
        inside = (
            plain and value >= bounds.get("minimum", -1e9) and value <= bounds.get("maximum", 1e9)
        )
        if "exclusiveMinimum" in bounds:
            inside = inside and value > bounds["exclusiveMinimum"]
        assert (re.search(pattern, text) is not None) == inside, (pattern, text)


# 3. a checkpoint at the mount's root


def test_model_path_may_be_the_mount_path() -> None:
    for path in ("/models", "/models/"):
        args = app_args(_render("--set", f"model.path={path}"))
        assert args["model"] == path
    assert "must lie under" in _refused("--set", "model.path=/modelsX")


def test_a_tokenizer_of_its_own_reaches_the_cluster_config_and_lies_under_the_mount() -> None:
    args = app_args(_render("--set", "model.tokenizerPath=/models/tok"))
    assert args["tokenizer"] == "/models/tok"
    assert ClusterConfig.model_validate(args).tokenizer == "/models/tok"
    assert "tokenizer" not in app_args(_render())  # (unset: the checkpoint's own)
    refusal = _refused("--set", "model.tokenizerPath=/tok")
    assert 'model.tokenizerPath "/tok" must lie under model.mountPath "/models"' in refusal
    refused = _refused("--set", "serve.engine.tokenizer=/models/tok")  # (the chart sets it)
    assert "tokenizer" in refused and "Additional property" in refused


# 4. the router's termination grace period


def _grace(manifests: list[Manifest], group: str) -> int:
    grace = ray_groups(manifests)[group]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert isinstance(grace, int)
    return grace


def test_router_pods_wait_for_the_router_graceful_shutdown() -> None:
    # app_builder: graceful_shutdown_timeout_s = 2 x max(prefill, decode drain) + 10
    manifests = _render("--set", "decode.drainTimeoutS=50", "--set", "prefill.drainTimeoutS=20")
    assert _grace(manifests, "router") >= 2 * 50 + 10
    assert _grace(manifests, "router") == 2 * 50 + 30
    assert _grace(manifests, "decode") == 50 + 30
    assert _grace(_render(), "router") == 2 * 30 + 30
    # colocated: the cluster config's prefill keeps its default drain (30 s) in the max
    colocated = _render("--set", "serve.mode=colocated", "--set", "decode.drainTimeoutS=5")
    assert _grace(colocated, "router") == 2 * 30 + 30
    fractional = _render("--set", "decode.drainTimeoutS=40.5")
    assert _grace(fractional, "router") >= 2 * 40.5 + 10


# 5. ports Ray owns


@pytest.mark.parametrize(
    ("setting", "owner"),
    [
        ("ports.http=6379", "Ray's GCS"),
        ("ports.metrics=10001", "Ray client server"),
        ("ports.grpc=10002", "Ray's worker ports"),
        ("ports.direct=19999", "Ray's worker ports"),
        ("ports.metrics=15000", "Ray's worker ports"),
        ("ports.grpc=52365", "dashboard agent"),
    ],
)
def test_ports_ray_owns_are_refused(setting: str, owner: str) -> None:
    err = _refused("--set", setting)
    assert setting.split("=")[0] in err and owner in err, err


def test_worker_port_range_follows_ray_start_params() -> None:
    sets = ("--set-string", "decode.rayStartParams.min-worker-port=20000")
    sets += ("--set-string", "decode.rayStartParams.max-worker-port=20999")
    assert "Ray's worker ports" in _refused(*sets, "--set", "ports.grpc=20500")
    _render("--set", "ports.grpc=20500")  # outside the default range


def test_haproxy_ports_are_refused_with_the_haproxy_ingress() -> None:
    haproxy = ("--set", "serve.ingress=haproxy")
    assert "HAProxy" in _refused(*haproxy, "--set", "ports.grpc=30500")
    assert "HAProxy" in _refused(*haproxy, "--set", "ports.direct=8404")
    _render("--set", "ports.grpc=30500")  # Serve's own proxy: no HAProxy ports


# 6. Kubernetes quantities


@pytest.mark.parametrize(
    "setting",
    ["decode.memory=lots", "prefill.shmSize=2GB", "head.memory=-1Gi", "router.memory=4 Gi"],
)
def test_memory_and_shm_size_must_be_quantities(setting: str) -> None:
    assert setting.split("=")[0] in _refused("--set", setting)


@pytest.mark.parametrize(
    "setting",
    [
        "decode.memory=32Gi",
        "decode.memory=17179869184",
        "prefill.shmSize=1.5Gi",
        "decode.memory=16G",
    ],
)
def test_quantities_render(setting: str) -> None:
    _render("--set", setting)


# 7. Ray's object store fits /dev/shm


def _object_store(manifests: list[Manifest], group: str) -> int:
    return int(ray_groups(manifests)[group]["rayStartParams"]["object-store-memory"])


def test_object_store_fits_dev_shm() -> None:
    gib = 1024**3
    manifests = _render()
    for group in ("prefill", "decode"):
        spec = ray_groups(manifests)[group]["template"]["spec"]
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["sizeLimit"] == "2Gi"
        assert 0 < _object_store(manifests, group) <= 2 * gib
    # a small pod: Ray's own 30 % of memory, when that is below /dev/shm
    small = _render("--set", "decode.memory=4Gi", "--set", "decode.shmSize=4Gi")
    assert _object_store(small, "decode") == int(0.3 * 4 * gib)
    # an explicit setting wins; no shmSize: Ray decides
    own = _render("--set-string", "decode.rayStartParams.object-store-memory=1000000000")
    assert _object_store(own, "decode") == 1000000000
    none = _render("--set", "decode.shmSize=null")
    assert "object-store-memory" not in ray_groups(none)["decode"]["rayStartParams"]


def test_a_dev_shm_too_small_for_rays_object_store_is_refused() -> None:
    assert "decode.shmSize" in _refused("--set", "decode.shmSize=64Mi")


def test_schema_keeps_the_chart_limits_in_step() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    num_gpus = schema["decode"]["properties"]["numGpus"]
    assert {b.get("type") for b in num_gpus["anyOf"]} == {"number", "string"}
