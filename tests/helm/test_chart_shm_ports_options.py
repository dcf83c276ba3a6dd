"""Three gaps of the chart, closed: the head and router pods' /dev/shm (Ray's object store fell
back to /tmp there), the head's GCS and client ports (the container kept 6379 and 10001 whatever
`head.rayStartParams` said), and cluster-config settings the values could not reach (CORS
origins, the Responses store, KV checksums, the chunk publisher, per-replica custom resources).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from tandem.deploy.cluster_config import ClusterConfig
from tests.helm.chart import (
    Manifest,
    app_args,
    ray_groups,
    run_helm,
    serve_config,
    template_args,
)
from tests.helm.semantics import build_deployments, check_all

GIB = 1024**3


def _helm(*args: str, values: Path | None = None) -> Any:
    return run_helm(*template_args(values), *args)


def _render(*args: str, values: Path | None = None) -> list[Manifest]:
    done = _helm(*args, values=values)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _refused(*args: str, values: Path | None = None) -> str:
    done = _helm(*args, values=values)
    assert done.returncode != 0, f"rendered with {args}"
    return str(done.stderr)


def _values_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


# 1. /dev/shm on the head and router pods


def _shm(group: dict[str, Any]) -> str | None:
    """The sizeLimit of the group's memory-backed /dev/shm (None: the runtime's own)."""
    spec = group["template"]["spec"]
    mounts = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    if not mounts:
        return None
    (volume,) = [v for v in spec["volumes"] if v["name"] == mounts[0]["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    size = volume["emptyDir"]["sizeLimit"]
    assert isinstance(size, str)
    return size


def test_head_and_router_pods_get_a_memory_backed_dev_shm() -> None:
    # without it the container runtime's 64Mi /dev/shm is far below Ray's object store (30 % of
    # the pod's memory), and Ray put the store in /tmp on these pods
    groups = ray_groups(_render())
    for name in ("head", "router", "prefill", "decode"):
        assert _shm(groups[name]) is not None, name
    assert (_shm(groups["head"]), _shm(groups["router"])) == ("1Gi", "1Gi")
    for name in ("head", "router"):
        store = int(groups[name]["rayStartParams"]["object-store-memory"])
        assert store == int(0.8 * GIB), name  # 80 % of 1Gi, below 30 % of 8Gi / 4Gi


def test_head_and_router_shm_size_can_be_set_or_turned_off() -> None:
    groups = ray_groups(_render("--set", "head.shmSize=2Gi", "--set", "router.shmSize=512Mi"))
    assert (_shm(groups["head"]), _shm(groups["router"])) == ("2Gi", "512Mi")
    assert int(groups["head"]["rayStartParams"]["object-store-memory"]) == int(1.6 * GIB)
    assert int(groups["router"]["rayStartParams"]["object-store-memory"]) == int(0.4 * GIB)
    # a small router pod: Ray's own 30 % of memory, when that is below 80 % of /dev/shm
    small = ray_groups(_render("--set", "router.memory=2Gi", "--set", "router.shmSize=2Gi"))
    assert int(small["router"]["rayStartParams"]["object-store-memory"]) == int(0.3 * 2 * GIB)
    # null: no memory-backed /dev/shm, and Ray sizes its store itself
    off = ray_groups(_render("--set", "head.shmSize=null", "--set", "router.shmSize=null"))
    for name in ("head", "router"):
        assert _shm(off[name]) is None, name
        assert "object-store-memory" not in off[name]["rayStartParams"], name
        assert "dshm" not in [v["name"] for v in off[name]["template"]["spec"]["volumes"]]
    # an explicit object-store-memory wins
    own = ray_groups(_render("--set-string", "head.rayStartParams.object-store-memory=200000000"))
    assert own["head"]["rayStartParams"]["object-store-memory"] == "200000000"


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("head.shmSize=2GB", "head.shmSize"),
        ("router.shmSize=lots", "router.shmSize"),
        ("head.shmSize=64Mi", "head.shmSize (64Mi) and head.memory (8Gi) leave Ray's object"),
        ("router.shmSize=64Mi", "router.shmSize (64Mi) and router.memory (4Gi) leave Ray's"),
    ],
)
def test_head_and_router_shm_size_are_checked_as_the_workers_are(
    setting: str, message: str
) -> None:
    assert message in _refused("--set", setting)


# 2. the head's GCS and Ray client ports


def _head_ports(manifests: list[Manifest]) -> dict[str, int]:
    container = ray_groups(manifests)["head"]["template"]["spec"]["containers"][0]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_head_container_ports_follow_the_gcs_and_client_ports() -> None:
    # KubeRay's head Service exposes the head container's ports, and the workers join the GCS
    # at rayStartParams `port`: a container port of 6379 left a GCS on 6380 unreachable
    default = _render()
    assert (_head_ports(default)["gcs"], _head_ports(default)["client"]) == (6379, 10001)
    head_params = ray_groups(default)["head"]["rayStartParams"]
    assert "port" not in head_params and "ray-client-server-port" not in head_params
    moved = _render(
        "--set-string",
        "head.rayStartParams.port=6380",
        "--set-string",
        "head.rayStartParams.ray-client-server-port=9001",
    )
    assert (_head_ports(moved)["gcs"], _head_ports(moved)["client"]) == (6380, 9001)
    params = ray_groups(moved)["head"]["rayStartParams"]
    # KubeRay's rayStartParams are strings
    assert (params["port"], params["ray-client-server-port"]) == ("6380", "9001")
    assert check_all(moved, build_deployments(serve_config(moved))) == []


def test_ports_follow_the_moved_gcs_and_client_ports() -> None:
    moved = ("--set-string", "head.rayStartParams.port=6380")
    assert "Ray's GCS" in _refused(*moved, "--set", "ports.http=6380")
    assert _head_ports(_render(*moved, "--set", "ports.metrics=6379"))["metrics"] == 6379


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"port": "gcs"}, 'head.rayStartParams.port ("gcs"), the GCS port (default 6379), must'),
        ({"port": "0"}, 'head.rayStartParams.port ("0")'),
        ({"port": "06370"}, 'head.rayStartParams.port ("06370")'),  # Helm: octal
        ({"ray-client-server-port": "65536"}, 'ray-client-server-port ("65536")'),
        ({"ray-client-server-port": ""}, 'ray-client-server-port (""), the Ray client server'),
        (
            {"port": "9001", "ray-client-server-port": "9001"},
            "port and ray-client-server-port are both 9001",
        ),
        ({"ray-client-server-port": "10101"}, "lies in Ray's worker ports 10002-19999 on the head"),
        (
            {"port": "21000", "min-worker-port": "20000", "max-worker-port": "22000"},
            "head.rayStartParams.port (21000) lies in Ray's worker ports 20000-22000",
        ),
        ({"port": "52365"}, "is Ray's dashboard agent port on the head"),
    ],
    ids=str,
)
def test_head_ports_the_chart_cannot_expose_are_refused(
    tmp_path: Path, params: dict[str, str], message: str
) -> None:
    values = _values_file(tmp_path, {"head": {"rayStartParams": params}})
    assert message in _refused(values=values)


# 3. cluster-config settings


OPTIONS: dict[str, Any] = {
    "serve": {
        "corsAllowedOrigins": ["https://app.example.com"],
        "responsesStoreSize": 50,
        "checksums": True,
        "chunkPublisher": False,
        "logRequests": False,
    },
    "router": {"replicaRayResources": {"edge": 1}, "extraRayResources": {"edge": 1}},
    "prefill": {"replicaRayResources": {"nic": 0.5}, "extraRayResources": {"nic": 1}},
    "decode": {
        "replicasPerPod": 2,
        "cpu": 4,
        "replicaRayResources": {"accel-a100": 1},
        "extraRayResources": {"accel-a100": 2},
    },
}


def test_the_settings_reach_the_serve_config_and_the_cluster_config(tmp_path: Path) -> None:
    manifests = _render(values=_values_file(tmp_path, OPTIONS))
    args = app_args(manifests)
    assert args["router"]["cors_allowed_origins"] == ["https://app.example.com"]
    assert args["router"]["responses_store_size"] == 50
    assert args["router"]["log_requests"] is False
    assert (args["checksums"], args["chunk_publisher"]) == (True, False)
    assert args["prefill"]["resources"] == {"prefill": 1, "nic": 0.5}
    assert args["decode"]["resources"] == {"decode": 1, "accel-a100": 1}
    config = serve_config(manifests)
    ServeDeploySchema.model_validate(config)
    (router,) = config["applications"][0]["deployments"]
    assert router["ray_actor_options"]["resources"] == {"router": 1, "edge": 1}
    cluster = ClusterConfig.model_validate(args)
    assert cluster.router.cors_allowed_origins == ["https://app.example.com"]
    assert cluster.router.responses_store_size == 50
    assert (cluster.checksums, cluster.chunk_publisher) == (True, False)
    settings = cluster.with_auth_token("t").worker_settings("prefill", "/models/model", "r")
    assert (settings.checksums, settings.hand_off) == (True, False)
    assert cluster.decode.ray_actor_options()["resources"] == {"decode": 1, "accel-a100": 1}
    # tandem's app builder asks Ray for them, and the groups' pods offer them
    deployments = build_deployments(config)
    wanted = {d.name: d.ray_actor_options["resources"] for d in deployments}
    assert wanted == {
        "router": {"router": 1, "edge": 1},
        "prefill": {"prefill": 1, "nic": 0.5},
        "decode": {"decode": 1, "accel-a100": 1},
    }
    assert check_all(manifests, deployments) == []


def test_off_is_a_setting_too(tmp_path: Path) -> None:
    # [] turns CORS off and 0 keeps no Responses reply: neither may read as "unset"
    values = {
        "serve": {
            "corsAllowedOrigins": [],
            "responsesStoreSize": 0,
            "checksums": False,
            "chunkPublisher": True,
        }
    }
    args = app_args(_render(values=_values_file(tmp_path, values)))
    assert args["router"]["cors_allowed_origins"] == []
    assert args["router"]["responses_store_size"] == 0
    assert (args["checksums"], args["chunk_publisher"]) == (False, True)
    cluster = ClusterConfig.model_validate(args)
    assert (cluster.router.cors_allowed_origins, cluster.router.responses_store_size) == ([], 0)


def test_unset_settings_stay_out_of_the_serve_config() -> None:
    args = app_args(_render())
    assert not {"checksums", "chunk_publisher"} & set(args)
    assert not {"cors_allowed_origins", "responses_store_size", "log_requests"} & set(
        args["router"]
    )
    assert (args["prefill"]["resources"], args["decode"]["resources"]) == (
        {"prefill": 1},
        {"decode": 1},
    )
    default = ClusterConfig.model_validate(args)
    assert default.router.cors_allowed_origins == ["*"] and default.chunk_publisher


def test_settings_given_with_set() -> None:
    manifests = _render(
        "--set",
        "serve.corsAllowedOrigins={https://a.example,https://b.example}",
        "--set",
        "serve.responsesStoreSize=10",
        "--set",
        "serve.checksums=true",
        "--set",
        "decode.replicaRayResources.accel=0.5",
        "--set",
        "decode.extraRayResources.accel=0.5",
    )
    args = app_args(manifests)
    assert args["router"]["cors_allowed_origins"] == ["https://a.example", "https://b.example"]
    assert args["decode"]["resources"] == {"decode": 1, "accel": 0.5}  # a number, not "0.5"
    ClusterConfig.model_validate(args)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("serve.responsesStoreSize=-1", "serve.responsesStoreSize"),
        ("serve.checksums=maybe", "serve.checksums"),
        ("serve.chunkPublisher=1", "serve.chunkPublisher"),
        ("serve.logRequests=no", "serve.logRequests"),
        ("decode.replicaRayResources.accel=0", "decode.replicaRayResources.accel"),
        (
            "decode.replicaRayResources.accel=1",
            "decode.replicaRayResources.accel (1 per replica) is not on the decode pods",
        ),
        ("prefill.replicaRayResources.prefill=1", "prefill.replicaRayResources.prefill is the"),
        ("router.replicaRayResources.GPU=1", "router.replicaRayResources.GPU is one of Ray's"),
        # typos the cluster would refuse (or Kubernetes drop) only once deployed
        ("serve.transportOptions.timout=30", "Additional property timout is not allowed"),
        ("decode.gpuResourceName=", "decode.gpuResourceName: String length must be"),
        ("router.extraEnv[0].name=A,router.extraEnv[0].val=b", "Additional property val is"),
        ("prefill.tolerations[0].key=a,prefill.tolerations[0].efect=x", "property efect is"),
    ],
)
def test_bad_settings_are_refused(setting: str, message: str) -> None:
    assert message in _refused("--set", setting)


def test_replica_resources_must_fit_every_replica_of_a_pod() -> None:
    # two replicas per pod asking for 1 each need 2 on the pod: 1 would hold only one of them
    sets = ["--set", "decode.replicasPerPod=2", "--set", "decode.cpu=4"]
    sets += ["--set", "decode.replicaRayResources.accel=1"]
    err = _refused(*sets, "--set", "decode.extraRayResources.accel=1")
    assert "set decode.extraRayResources.accel to 2 or more (now 1)" in err
    _render(*sets, "--set", "decode.extraRayResources.accel=2")
    # 3 x 0.1 is 0.30000000000000004 in floats: 0.3 on the pod is enough
    thirds = ["--set", "decode.replicasPerPod=3", "--set", "decode.cpu=6"]
    thirds += [
        "--set",
        "decode.replicaRayResources.x=0.1",
        "--set",
        "decode.extraRayResources.x=0.3",
    ]
    _render(*thirds)
