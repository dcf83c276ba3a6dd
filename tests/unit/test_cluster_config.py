"""The cluster config: the committed example and Serve config validate; bad settings are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tandem.deploy.cluster_config import ClusterConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_example_config_validates_and_flags_override_it() -> None:
    cfg = ClusterConfig.from_file(DEPLOY / "cluster.example.yaml", port=9000, transport="ucx")
    assert (cfg.port, cfg.transport, cfg.prefill.replicas) == (9000, "ucx", 1)
    assert cfg.admission.tenants["interactive"].deadline_ms == 2000
    assert cfg.routing.policy == "cache_affinity"
    assert cfg.engine_config("prefill", "/m").block_size == 16


def test_the_serve_config_args_are_cluster_config_fields() -> None:
    serve = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    ClusterConfig.model_validate(serve["applications"][0]["args"])


@pytest.mark.parametrize(
    "bad",
    [
        {"transport": "local"},
        {"transport": "carrier-pigeon"},
        {"engine": {"block_sise": 16}},
        {"prefill": {"replicas": 0}},
        {"routing": {"policy": "random"}},
        {"admission": {"safety_factor": 0.5}},
    ],
)
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate(bad)


def test_router_replicas_can_ask_for_custom_ray_resources() -> None:
    plain = ClusterConfig().router.ray_actor_options()
    assert plain == {"num_cpus": 0.1}
    pinned = ClusterConfig.model_validate({"router": {"resources": {"router": 1}, "num_cpus": 0.5}})
    assert pinned.router.ray_actor_options() == {"num_cpus": 0.5, "resources": {"router": 1}}
