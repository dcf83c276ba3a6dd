"""One local Ray cluster (and Serve) per test run, shared by every integration test.

`deploy_tandem(**config)` (re)deploys the application with a `ClusterConfig` and returns its
base URL; the cluster, Serve's HTTP port and the gRPC port stay the same across deployments.

A deployment takes 15-30 s to start here, so the tests run grouped by the one they use (see
`pytest_collection_modifyitems`): every test on 1 prefill + 1 decode, then every test on 2 + 2,
then the modules that deploy their own configs. A module says which default it uses with
`DEPLOYMENT = "1x1"` or `"2x2"`, or through the `base_url` fixture's parameter.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

APP = "tandem"


TEST_PORTS = range(20000, 32000)
"""Where the tests' ports come from: above Ray's worker ports (10002-19999) and below the
kernel's ephemeral range (32768-60999 here), from which every process that binds port 0 (Ray's
own servers among them) takes one. A port found free by binding port 0 and closing it could be
taken by such a process before the server it was meant for opens it."""


def free_port() -> int:
    """A port in `TEST_PORTS` that nothing listens on now, drawn at random (so that two test
    runs on the machine seldom draw the same one)."""
    for port in random.sample(TEST_PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


DEPLOYMENT_GROUPS = {"1x1": 0, "1x1-direct": 0, "2x2": 1}
"""The order of the default deployments; tests on none of them (their own configs) come last."""


def deployment_group(item: pytest.Item) -> int:
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("base_url") if callspec is not None else None
    if name is None:
        name = getattr(getattr(item, "module", None), "DEPLOYMENT", None)
    return DEPLOYMENT_GROUPS.get(str(name), len(set(DEPLOYMENT_GROUPS.values())))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Integration tests grouped by deployment (stable: module and test order are kept within
    a group), in the places the integration tests held among the others."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if here in item.path.parents]
    ordered = sorted((items[i] for i in places), key=deployment_group)
    for place, item in zip(places, ordered, strict=True):
        items[place] = item


class Cluster:
    def __init__(self, http_port: int, grpc_port: int, model: Path) -> None:
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.direct_port = free_port()
        self.model = model
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.direct_url = f"http://127.0.0.1:{self.direct_port}"
        """The router's own port (`direct_port`): the same API without Serve's proxy."""
        self.config: dict[str, Any] = {}

    def deploy(self, **overrides: Any) -> str:
        from ray import serve

        from tandem.deploy.app_builder import build_app
        from tandem.deploy.cluster_config import ClusterConfig

        config = {
            "model": str(self.model),
            "served_model_name": ["tiny", "tiny-alias"],  # (a second name: vLLM's several)
            "grpc_port": self.grpc_port,
            "direct_port": self.direct_port,
            "engine": {"num_kv_blocks": 512, "max_num_batched_tokens": 256},
            "prefill": {"num_cpus": 0.25},
            "decode": {"num_cpus": 0.25},
            **overrides,
        }
        if config == self.config:
            return self.base_url
        cluster_config = ClusterConfig(**config)
        serve.run(build_app(cluster_config), name=APP, route_prefix="/")
        self.config = config
        wait_ready(self.base_url, (cluster_config.api_keys() or [None])[0])
        roles = ["decode"] if cluster_config.mode == "colocated" else ["prefill", "decode"]
        self.wait_workers({r: getattr(cluster_config, r).replicas for r in roles})
        return self.base_url

    def wait_workers(self, expected: dict[str, int], timeout: float = 30) -> None:
        """Until /health counts `expected` live workers per role: the router learns of new
        replicas from the worker registry every few seconds, so right after a deploy it may
        still count only some of them."""
        deadline = time.monotonic() + timeout
        while True:
            health = requests.get(f"{self.base_url}/health", timeout=10).json()
            if health.get("workers") == expected or time.monotonic() > deadline:
                return
            time.sleep(0.25)

    def deploy_pd(self, replicas: int = 1) -> str:
        """`replicas` prefill + `replicas` decode workers (the default deployment)."""
        role = {"replicas": replicas, "num_cpus": 0.25}
        return self.deploy(prefill=role, decode=dict(role))

    def workers(self) -> list[dict[str, Any]]:
        """`/debug/workers`: each worker's stats, read from it now (retried while one of the
        router's workers is not answering, e.g. a replica that is shutting down)."""
        deadline = time.monotonic() + 10
        while True:
            resp = requests.get(f"{self.base_url}/debug/workers", timeout=10)
            workers: list[dict[str, Any]] = resp.json()["workers"]
            if not any("error" in w for w in workers) or time.monotonic() > deadline:
                return workers
            time.sleep(0.1)


def wait_ready(base_url: str, api_key: str | None = None, timeout: float = 120.0) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base_url}/v1/models", headers=headers, timeout=5).status_code == 200:
                return
        except requests.RequestException:  # not up yet, or still starting its replicas
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{base_url} did not become ready in {timeout}s")


@pytest.fixture(scope="session")
def cluster(tiny_checkpoint: Callable[..., Path]) -> Iterator[Cluster]:
    import ray
    from ray import serve

    from tandem.deploy.ingress import DEFAULT_INGRESS, Ingress, ingress_environment

    # The cluster runs the ingress `tandem serve` starts by default, or the one named by
    # TANDEM_TEST_INGRESS (proxy | haproxy). The variables reach the Ray processes through
    # ray.init's environment and leave this one right after, so that a `tandem serve` a test
    # starts makes its own choice.
    ingress = Ingress(os.environ.get("TANDEM_TEST_INGRESS", DEFAULT_INGRESS.value))
    env = ingress_environment(ingress, os.environ)
    os.environ.update(env)
    try:
        ray.init(num_cpus=4, include_dashboard=False, namespace="tandem-tests", log_to_driver=False)
    finally:
        for name in env:
            os.environ.pop(name, None)
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield Cluster(http_port, free_port(), tiny_checkpoint())
    finally:
        serve.shutdown()
        ray.shutdown()


# The OpenAI tests' deployments and reference (`openai_shared.py`); a module may define its own
# `base_url`.
@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> Any:
    """The in-process engine on the cluster's model: what each answer must equal."""
    from tandem import LLM

    return LLM(model=str(cluster.model), num_kv_blocks=512)


@pytest.fixture(scope="module")
def expected(reference: Any) -> list[Any]:
    """`openai_shared.PROMPTS`' greedy outputs of `MAX_TOKENS` tokens, in process."""
    from tandem import SamplingParams
    from tests.integration.openai_shared import MAX_TOKENS, PROMPTS

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return reference.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module", params=["1x1", "1x1-direct", "2x2"])
def base_url(request: pytest.FixtureRequest, cluster: Cluster) -> str:
    """1 prefill + 1 decode worker through Serve's proxy, then the same on the router's own
    port, then 2 + 2 (a deployment is kept while its config is)."""
    url = cluster.deploy_pd(int(request.param[0]))
    if request.param.endswith("-direct"):
        wait_ready(cluster.direct_url)
        return cluster.direct_url
    return url
