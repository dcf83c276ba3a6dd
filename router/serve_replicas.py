"""How many replicas of each deployment of a Serve application are in each state, read cheaply.

`serve.status()` builds Serve's pydantic models of the whole instance and, for each
deployment, cloudpickles its request router class (which walks `sys.modules`): ~20 ms in a
bare driver and ~100 ms of the GIL in a busy router replica, whose event loop streams every
token meanwhile. The controller's plain details (`get_serve_details`, the dict those models
are built from) cost ~2 ms; `serve.status()` stays the fallback where they cannot be had.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ray import serve

logger = logging.getLogger("tandem.router")

ReplicaStates = dict[str, Counter[str]]
"""Per deployment name, its replicas' count per state ("RUNNING", "STARTING", ...)."""


def serve_details() -> Mapping[str, Any] | None:
    """The controller's plain details of every application (None where this Ray's private API
    differs). Blocking (a call to Serve's controller): run it off the event loop."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        return client.get_serve_details() if client is not None else None
    except (ImportError, AttributeError, TypeError) as exc:  # (another Ray's private API)
        logger.debug("Serve's plain details unavailable (%r): serve.status() instead", exc)
        return None


def replica_states(app_name: str) -> ReplicaStates:
    """The replicas of `app_name`'s deployments by state (empty for an unknown application).
    Blocking (a call to Serve's controller): run it off the event loop."""
    details = serve_details()
    if details is not None:
        return states_from_details(details, app_name)
    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {name: Counter(d.replica_states) for name, d in app.deployments.items()}


def states_from_details(details: Mapping[str, Any], app_name: str) -> ReplicaStates:
    """`replica_states` from the controller's details dict (`get_serve_details`)."""
    app = (details.get("applications") or {}).get(app_name) or {}
    return {
        name: Counter(_state_name(r.get("state")) for r in deployment.get("replicas") or [])
        for name, deployment in (app.get("deployments") or {}).items()
    }


def state_of(details: Mapping[str, Any], app_name: str, replica_id: str) -> str | None:
    """The state of the replica `replica_id` of `app_name` in the details, if listed."""
    app = (details.get("applications") or {}).get(app_name) or {}
    for deployment in (app.get("deployments") or {}).values():
        for replica in deployment.get("replicas") or []:
            if replica.get("replica_id") == replica_id:
                return _state_name(replica.get("state"))
    return None


def _state_name(state: Any) -> str:
    return str(getattr(state, "value", state))  # (a ReplicaState enum member, or its value)
