"""A redeploy of the application (new router settings, no `auth_token` given) keeps the
generated cluster token: the workers still running serve the new router, so requests sent
during the rollout all succeed (a fresh token made them refuse it: 503s until they drained)."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_requests_during_a_redeploy_all_succeed(cluster: Cluster) -> None:
    # The old workers' drain outlasts the streams (eight of 1,800 tokens took over the default
    # 30 s on a slow 2-core host while the new replicas started: the drain timed out, the
    # router moved the streams and was killed at its own grace's end with two still open).
    role = {"replicas": 1, "num_cpus": 0.25, "drain_timeout_s": 120}
    cluster.deploy(prefill=role, decode=dict(role))
    statuses: list[int] = []
    failures: list[str] = []  # (an exception in a thread is only a pytest warning: kept here)
    done = threading.Event()

    def send() -> None:
        body = {"model": "tiny", "prompt": "during the rollout", "max_tokens": 4}
        while not done.is_set():
            try:
                resp = requests.post(f"{cluster.base_url}/v1/completions", json=body, timeout=120)
                statuses.append(resp.status_code)
            except requests.ConnectionError:  # (the router replica being swapped: Serve's)
                pass
            except Exception as exc:  # a request that hangs past its timeout, above all
                # (120 s: Serve holds a request while no router replica is up, as long as the
                # new one takes to start: 28 s on a slow 2-core host, past the 30 s of before)
                failures.append(f"completion: {exc!r}")
            time.sleep(0.05)

    def stream() -> None:  # (keeps the old workers busy while they drain)
        body = {"model": "tiny", "prompt": "long", "max_tokens": 1800, "stream": True,
                "ignore_eos": True}  # fmt: skip
        try:
            with requests.post(
                f"{cluster.base_url}/v1/completions", json=body, stream=True, timeout=120
            ) as resp:
                lines = [line for line in resp.iter_lines() if line]
            if resp.status_code != 200 or lines[-1:] != [b"data: [DONE]"]:
                failures.append(f"stream: {resp.status_code}, ended with {lines[-1:]}")
        except Exception as exc:
            failures.append(f"stream: {exc!r}")

    streams = [threading.Thread(target=stream, daemon=True) for _ in range(8)]
    for thread in streams:
        thread.start()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        cluster.deploy(prefill=role, decode=dict(role), router={"request_timeout_s": 300})
        for thread in streams:  # (requests go on while the old workers drain)
            thread.join(timeout=120)
    finally:
        done.set()
        sender.join(timeout=60)
    assert failures == []
    assert statuses and set(statuses) == {200}, statuses
