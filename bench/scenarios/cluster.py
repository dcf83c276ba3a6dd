"""One local Ray cluster for every scenario, redeploying the tandem app per configuration."""

from __future__ import annotations

import os
import socket
import time
from types import TracebackType
from typing import Any

import requests

from tandem.deploy.cluster_config import ClusterConfig

APP = "tandem-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class ScenarioCluster:
    """`with ScenarioCluster(model) as c: url = c.deploy(mode="colocated", ...)`."""

    def __init__(self, model: str, num_cpus: int = 4) -> None:
        self.model = model
        self.num_cpus = num_cpus
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.config: ClusterConfig | None = None

    def __enter__(self) -> ScenarioCluster:
        import ray
        from ray import serve

        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            num_cpus=self.num_cpus,
            include_dashboard=False,
            namespace="tandem-bench",
            log_to_driver=False,
        )
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import ray
        from ray import serve

        self._undeploy()
        serve.shutdown()
        ray.shutdown()

    def deploy(self, **fields: Any) -> str:
        """Replaces the running app with one built from `ClusterConfig(model=..., **fields)`;
        returns the base URL once a request has gone through (workers warm)."""
        from ray import serve

        from tandem.deploy.app_builder import build_app

        self._undeploy()
        config = ClusterConfig(
            model=self.model, served_model_name="bench", app_name=APP, grpc_port=0, **fields
        )
        serve.run(build_app(config), name=APP, route_prefix="/")
        self.config = config
        self._wait_ready()
        return self.base_url

    def _undeploy(self) -> None:
        from ray import serve

        from tandem.deploy.app_builder import registry_name
        from tandem.engine.worker_registry import kill_registry

        if self.config is not None:
            serve.delete(APP)
            kill_registry(registry_name(self.config))
            self.config = None

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        body: dict[str, Any] = {
            "model": "bench",
            "prompt": [5, 6, 7, 8],
            "max_tokens": 2,
            "ignore_eos": True,
        }
        while time.monotonic() < deadline:
            try:
                health = requests.get(f"{self.base_url}/health", timeout=5)
                if health.status_code == 200:
                    r = requests.post(f"{self.base_url}/v1/completions", json=body, timeout=60)
                    if r.status_code == 200:
                        return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.base_url} not ready in {timeout}s")
