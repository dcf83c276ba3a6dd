"""The replicas of a Serve application by state, from the controller's plain details."""

from __future__ import annotations

from collections import Counter

from ray.serve._private.common import ReplicaState

from tandem.router.serve_replicas import states_from_details


def test_states_are_counted_per_deployment_from_enum_members_or_names() -> None:
    details = {
        "applications": {
            "tandem": {
                "deployments": {
                    "decode": {
                        "replicas": [
                            {"state": ReplicaState.RUNNING, "replica_id": "a"},
                            {"state": ReplicaState.STARTING, "replica_id": "b"},
                            {"state": "RUNNING", "replica_id": "c"},
                        ]
                    },
                    "prefill": {"replicas": []},
                    "router": {"replicas": [{"state": ReplicaState.STOPPING}]},
                }
            },
            "other": {"deployments": {"x": {"replicas": [{"state": "RUNNING"}]}}},
        }
    }
    states = states_from_details(details, "tandem")
    assert states == {
        "decode": Counter({"RUNNING": 2, "STARTING": 1}),
        "prefill": Counter(),
        "router": Counter({"STOPPING": 1}),
    }
    assert states_from_details(details, "gone") == {} == states_from_details({}, "tandem")
