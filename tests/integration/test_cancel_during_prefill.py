"""A client that leaves while its prompt is still being prefilled cancels it on prefill too."""

from __future__ import annotations

import time

import pytest
import requests

from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_disconnect_during_prefill_cancels_prefill_and_decode(cluster: Cluster) -> None:
    # a prefill chunk of 8 tokens makes a 1,900-token prompt take ~240 engine steps
    base_url = cluster.deploy(
        prefill={"num_cpus": 0.25, "engine": {"max_num_batched_tokens": 8}},
        decode={"num_cpus": 0.25},
    )
    prompt = [10 + i % 400 for i in range(1900)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = {w["role"]: w for w in cluster.workers()}
        prefill, decode = workers["prefill"], workers["decode"]
        if (
            prefill["num_cancelled"] == 1
            and prefill["num_free_blocks"] == prefill["num_blocks"]
            and prefill["num_requests"] == 0
            and decode["num_free_blocks"] == decode["num_blocks"]
            and decode["num_reservations"] == decode["num_requests"] == 0
        ):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"not cancelled and released on both sides: {workers}")
