"""What `tandem serve` tells the operator about the roles it deploys (no Ray)."""

from __future__ import annotations

from tandem.deploy.cluster_config import ClusterConfig
from tandem.deploy.serve_banner import workers_summary
from tandem.deploy.serve_cmd import _ignored_in_colocated

SCALING = {"min_replicas": 1, "max_replicas": 3}


def test_fixed_replicas_summary_is_unchanged() -> None:
    cfg = ClusterConfig(prefill={"replicas": 2}, decode={"replicas": 1})
    assert workers_summary(cfg) == "2 prefill + 1 decode workers, shm KV transport"


def test_autoscaled_roles_show_their_range() -> None:
    cfg = ClusterConfig(
        prefill={"autoscaling": SCALING}, decode={"replicas": 2, "autoscaling": SCALING}
    )
    assert workers_summary(cfg) == (
        "1 prefill (autoscaling 1..3) + 2 decode (autoscaling 1..3) workers, shm KV transport"
    )


def test_colocated_summary_shows_the_decode_range() -> None:
    cfg = ClusterConfig(mode="colocated", decode={"autoscaling": SCALING})
    assert workers_summary(cfg) == "1 colocated worker (prefill + decode) (autoscaling 1..3)"
    two = ClusterConfig(mode="colocated", decode={"replicas": 2})
    assert workers_summary(two) == "2 colocated workers (prefill + decode)"


def test_colocated_names_the_prefill_settings_it_ignores() -> None:
    cfg = ClusterConfig(mode="colocated", prefill={"replicas": 2, "autoscaling": SCALING})
    assert _ignored_in_colocated(cfg, prefill_flag=False) == [
        "prefill.autoscaling",
        "prefill.replicas",
    ]
    assert _ignored_in_colocated(cfg, prefill_flag=True) == [
        "prefill.autoscaling",
        "--prefill-replicas",
    ]
    assert _ignored_in_colocated(ClusterConfig(mode="colocated"), prefill_flag=False) == []
    pd = ClusterConfig(prefill={"autoscaling": SCALING})
    assert _ignored_in_colocated(pd, prefill_flag=True) == []
