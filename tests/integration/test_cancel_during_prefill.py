"""A client that leaves while its prompt is still being prefilled cancels it on prefill too."""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests

from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _roles(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {w["role"]: w for w in cluster.workers()}


def _ended_early(prefill: dict[str, Any]) -> int:
    """Transfers the prefill worker stopped before sending everything: cancelled by the router,
    or refused by decode because decode had already dropped the reservation (the race of the
    two cancels decides which)."""
    return int(prefill["num_cancelled"]) + int(prefill["num_failed"])


def _idle(worker: dict[str, Any]) -> bool:
    return (
        worker["num_free_blocks"] == worker["num_blocks"]
        and worker["num_requests"] == 0
        and worker.get("num_reservations", 0) == worker.get("num_held_reservations", 0) == 0
    )


def test_disconnect_during_prefill_cancels_prefill_and_decode(cluster: Cluster) -> None:
    # a prefill chunk of 4 tokens makes a 1,900-token prompt take ~475 engine steps
    base_url = cluster.deploy(
        prefill={"num_cpus": 0.25, "engine": {"max_num_batched_tokens": 4}},
        decode={"num_cpus": 0.25},
    )
    prompt = [10 + i % 400 for i in range(1900)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 100, "stream": True}
    before = _ended_early(_roles(cluster)["prefill"])
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        deadline = time.monotonic() + 30
        while _roles(cluster)["prefill"]["num_requests"] == 0:  # wait until prefill is running
            assert time.monotonic() < deadline, "the request never reached the prefill worker"
            time.sleep(0.01)
    # the connection is closed here, mid-prefill
    deadline = time.monotonic() + 30
    while True:
        workers = _roles(cluster)
        if _ended_early(workers["prefill"]) == before + 1 and all(map(_idle, workers.values())):
            break
        assert time.monotonic() < deadline, f"not cancelled and released on both sides: {workers}"
        time.sleep(0.1)
