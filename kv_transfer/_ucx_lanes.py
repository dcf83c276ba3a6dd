"""The UCX transport's workers ("lanes", see `ucx.py`): how each is made, how a header frame is
read, how frames nobody may receive are thrown away, and how one is emptied of the messages
nobody received before it is destroyed. Importing this imports ucxx."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables UCX 1.21 lacks
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

__all__ = [
    "LANE_SCHEMES",
    "Array",
    "discard",
    "discard_matching",
    "drain_unexpected",
    "json_object",
    "new_worker",
    "receive_frame",
    "settle",
    "tag_of",
    "ucx_api",
]

LANE_SCHEMES = ("put_zcopy", "get_zcopy")
"""Each lane's UCX rendezvous unless the environment sets ``UCX_RNDV_SCHEME`` (`ucx_config`
overrides both): on lane 0 the sender writes the pages into the receiver (~15 % faster at 1 MiB
here than UCX's default, which has the receiver read them), on lane 1 the receiver reads them,
so a split message is copied by both processes' threads at once (`split_min_bytes`)."""


def tag_of(conn: int, low: int) -> Any:
    """The UCX tag of a link's frame: its connection id over 16 bits of kind and sequence."""
    return ucx_api.UCXXTag((conn << 16) | low)


def new_worker(scheme: str, ucx_config: dict[str, str]) -> Any:
    """A UCX worker with tag matching and `scheme` rendezvous (see `LANE_SCHEMES`)."""
    # No WAKEUP feature: it halves UCX's shared-memory throughput here, so the thread polls.
    config = {} if "UCX_RNDV_SCHEME" in os.environ else {"RNDV_SCHEME": scheme}
    config.update(ucx_config)
    context = ucx_api.UCXContext(config_dict=config, feature_flags=(ucx_api.Feature.TAG,))
    return ucx_api.UCXWorker(context)


def drain_unexpected(worker: Any) -> None:
    """Takes the rendezvous messages nobody received (e.g. pages of a refused peer), which keep
    a put_zcopy worker from being destroyed (up to 64 MiB each; larger ones truncated)."""
    deadline = time.monotonic() + 1.0
    taken: list[tuple[Any, Any]] = []
    while time.monotonic() < deadline:
        probe = worker.tag_probe(ucx_api.UCXXTag(0), ucx_api.UCXXTagMask(0), True)
        if not probe.matched:
            break
        buffer = np.empty(max(1, min(probe.length, 64 << 20)), dtype=np.uint8)
        taken.append((worker.tag_recv_with_handle(Array(buffer), probe), buffer))
    while taken and time.monotonic() < deadline:
        worker.progress()
        taken = [(r, b) for r, b in taken if not r.completed]


def discard(worker: Any, probe: Any, busy: list[tuple[Any, Any]]) -> None:
    """Receives the probed frame into one byte (UCX truncates the rest); the request and its
    buffer go to `busy` until UCX completes it."""
    buffer = np.zeros(1, dtype=np.uint8)
    busy.append((worker.tag_recv_with_handle(Array(buffer), probe), buffer))


def discard_matching(worker: Any, tag: Any, mask: Any, busy: list[tuple[Any, Any]]) -> bool:
    """`discard`s up to 64 frames waiting on `worker` whose tag matches; whether any did."""
    found = False
    for _ in range(64):
        probe = worker.tag_probe(tag, mask, True)
        if not probe.matched:
            break
        discard(worker, probe, busy)
        found = True
    return found


def settle(workers: list[Any], idle_rounds: int = 3, max_rounds: int = 1000) -> None:
    """Progresses `workers` until `idle_rounds` rounds in a row find nothing to do: what UCX
    holds in its queues (e.g. a dead peer's last fragments in shared memory) is handled."""
    idle = 0
    for _ in range(max_rounds):
        idle = 0 if any([w.progress_once() for w in workers]) else idle + 1
        if idle == idle_rounds:
            return


def receive_frame(worker: Any, probe: Any, timeout_s: float) -> bytes | None:
    """The probed frame's bytes, or None (not received in `timeout_s`: frames over 8 KiB, UCX's
    rendezvous threshold, take a round trip)."""
    buffer = np.empty(probe.length, dtype=np.uint8)
    request = worker.tag_recv_with_handle(Array(buffer), probe)
    deadline = time.monotonic() + timeout_s
    while not request.completed and time.monotonic() < deadline:
        worker.progress()
    try:
        request.check_error()
    except Exception:
        return None
    return buffer.tobytes()


def json_object(raw: bytes | None) -> dict[str, Any] | None:
    """A frame's JSON object, or None (no frame, or not a JSON object)."""
    try:
        body = json.loads(raw) if raw is not None else None
    except Exception:  # (not only ValueError: deep nesting raises RecursionError)
        return None
    return body if isinstance(body, dict) else None
