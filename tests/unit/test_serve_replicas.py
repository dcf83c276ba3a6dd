"""The replicas of a Serve application by state, from the controller's plain details."""

from __future__ import annotations

from collections import Counter

from ray.serve._private.common import ReplicaState

from tandem.router.serve_replicas import state_of, states_from_details

DETAILS = {
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
                "router": {"replicas": [{"state": ReplicaState.STOPPING, "replica_id": "r"}]},
            }
        },
        "other": {"deployments": {"x": {"replicas": [{"state": "RUNNING"}]}}},
    }
}


def test_states_are_counted_per_deployment_from_enum_members_or_names() -> None:
    details = DETAILS
    states = states_from_details(details, "tandem")
    assert states == {
        "decode": Counter({"RUNNING": 2, "STARTING": 1}),
        "prefill": Counter(),
        "router": Counter({"STOPPING": 1}),
    }
    assert states_from_details(details, "gone") == {} == states_from_details({}, "tandem")


def test_a_replicas_own_state_is_found_by_its_id() -> None:
    assert state_of(DETAILS, "tandem", "r") == "STOPPING"
    assert state_of(DETAILS, "tandem", "b") == "STARTING"
    assert state_of(DETAILS, "tandem", "zz") is None and state_of({}, "tandem", "r") is None
