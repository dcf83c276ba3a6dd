"""What a router replica reads from Serve's controller every few seconds: how many replicas
each role should have (the autoscaler's target, for `tandem:role_target_replicas`), how many
routers run, and whether Serve stops this very replica (a redeploy, a scale-down).

Serve kills a stopping replica's process once its `graceful_shutdown_timeout_s` has passed;
the requests still running then are ended a moment before (`StreamDeadlines.cut_at`), with a
503 that says so, instead of a cut connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tandem.router.serve_replicas import (
    replica_states,
    serve_details,
    state_of,
    states_from_details,
)
from tandem.router.stream_deadlines import StreamDeadlines

logger = logging.getLogger("tandem.router")

STOP_MARGIN_S = 2.0
"""How long before Serve's kill a stopping router ends the requests it still runs."""

_WANTED = frozenset({"STARTING", "UPDATING", "RECOVERING", "RUNNING"})
"""The states of replicas that count towards a role's target (not stopping)."""


class ReplicaWatch:
    def __init__(
        self,
        app_name: str,
        replica_id: str,
        roles: tuple[str, ...],
        configured: dict[str, int],
        deadlines: StreamDeadlines,
        grace_s: float,
    ) -> None:
        """`configured`: the replicas per role the config asks for (until Serve says);
        `grace_s`: this replica's `graceful_shutdown_timeout_s` (0: nothing is cut)."""
        self.app_name, self.replica_id, self.roles = app_name, replica_id, roles
        self.targets: dict[str, int] = {"router": 1, **configured}
        self.running_routers = 1  # this one, until Serve's details say how many run
        self.deadlines = deadlines
        self.grace_s = grace_s
        self.stop_seen = False

    async def follow(self, every_s: float = 2.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                details = await asyncio.to_thread(serve_details)
                if details is None:
                    states = await asyncio.to_thread(replica_states, self.app_name)
                else:
                    states = states_from_details(details, self.app_name)
                    if state_of(details, self.app_name, self.replica_id) == "STOPPING":
                        self.stopping(every_s)
            except Exception as exc:  # the controller may be restarting; keep the last figures
                logger.debug("reading Serve's replica states failed: %r", exc)
                continue
            for role in (*self.roles, "router"):
                if (counts := states.get(role)) is not None:
                    self.targets[role] = sum(n for st, n in counts.items() if st in _WANTED)
                    if role == "router":
                        self.running_routers = max(1, counts["RUNNING"])

    def stopping(self, seen_within_s: float) -> None:
        """Serve stops this replica (seen within `seen_within_s` of its start): the requests
        still running when its grace is nearly out end then."""
        if self.stop_seen or not self.grace_s:
            return
        self.stop_seen = True
        left_s = max(0.0, self.grace_s - seen_within_s - STOP_MARGIN_S)
        self.deadlines.cut_at(
            asyncio.get_running_loop().time() + left_s,
            "the router serving this request is stopping (a redeploy or a scale-down) and the "
            f"request did not finish within its {self.grace_s:g}s grace: send it again",
        )
        logger.info(
            "router stopping: requests still running in %.0fs end then (%d running)",
            left_s,
            self.deadlines.running_count,
        )


def configured_targets(settings: dict[str, Any]) -> dict[str, int]:
    return {k: int(v) for k, v in dict(settings.get("replica_targets") or {}).items()}
