"""Autoscaling by role on the local cluster: a burst of streams raises decode from 1 to 2
replicas; once it stops, decode goes back to 1 while streams still run on the replica Serve
removes, which drains them. Every request, burst or not, completes with all its tokens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import requests

from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2.0,
    "running_seqs_per_replica": 4,  # the one signal on: it does not depend on machine speed
    "kv_usage_target": None,
    "itl_target_ms": None,
}
BURST = 12  # concurrent streams: ~3 replicas' worth, capped at max_replicas=2
KEEPERS = 4  # concurrent streams after the burst: one replica's worth (2 per replica at first)
BURST_TOKENS, KEEPER_TOKENS = 48, 1800
"""Keepers' streams are long, so a replica that had one when Serve chose to remove it still has
it when its drain starts. Serve marks the replica as stopping (the router then sends it nothing
new) a couple of seconds before it calls the drain: 512-token streams (~1.5 s here) had all
ended by then in one CI run, and 256-token ones in another."""
PHASE_TIMEOUT_S = 90.0


@dataclass
class Load:
    """Streaming clients that loop until told to stop; every outcome is recorded."""

    base_url: str
    completed: list[int] = field(default_factory=list)  # tokens of each finished request
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(self, client: openai.AsyncOpenAI, max_tokens: int, prompt: str) -> None:
        tokens, finish = 0, None
        try:
            stream = await client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except Exception as exc:  # recorded: the test fails on any
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return
        if finish != "length" or tokens != max_tokens:
            self.failures.append(f"cut short: finish={finish} tokens={tokens}/{max_tokens}")
        else:
            self.completed.append(tokens)

    async def loop(self, index: int, max_tokens: int) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        n = 0
        while not self.stop.is_set():
            await self.one(client, max_tokens, f"client {index} request {n}: tell a long story")
            n += 1
        await client.close()


def decode_replicas(cluster: Cluster) -> tuple[int, int]:
    """(decode workers taking requests, decode workers draining), as the router sees them."""
    workers = requests.get(f"{cluster.base_url}/debug/workers", timeout=10).json()["workers"]
    decode = [w for w in workers if w.get("role") == "decode" and "error" not in w]
    draining = sum(1 for w in decode if w.get("draining"))
    return len(decode) - draining, draining


async def watch_until(
    cluster: Cluster,
    want: int,
    timeline: list[tuple[float, int, int]],
    start: float,
    on_drain: asyncio.Event | None = None,
) -> None:
    """Polls the router until exactly `want` decode workers take requests and none drains;
    sets `on_drain` once it sees one draining."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while time.monotonic() < deadline:
        live, draining = await asyncio.to_thread(decode_replicas, cluster)
        if not timeline or timeline[-1][1:] != (live, draining):
            timeline.append((round(time.monotonic() - start, 1), live, draining))
        if draining and on_drain is not None:
            on_drain.set()
        if (live, draining) == (want, 0):
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"decode never settled at {want} replicas: {timeline}")


def wait_for_target_metric(cluster: Cluster, want: int, timeout: float = 15.0) -> None:
    """`tandem:role_target_replicas{role="decode"}` on /metrics follows Serve's replicas."""
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        text = requests.get(f"{cluster.base_url}/metrics", timeout=10).text
        line = next(
            (x for x in text.splitlines()
             if x.startswith("tandem:role_target_replicas{") and 'role="decode"' in x),
            "",
        )  # fmt: skip
        if line and float(line.rsplit(" ", 1)[1]) == want:
            return
        time.sleep(0.5)
    raise AssertionError(f"decode target replicas never {want}: {line!r}")


def registry_departures() -> list[dict[str, Any]]:
    import ray

    registry = ray.get_actor("tandem-registry-tandem", namespace="tandem")
    departures: list[dict[str, Any]] = ray.get(registry.departures.remote())
    return departures


def test_a_burst_scales_decode_up_and_the_scale_down_drains_its_streams(cluster: Cluster) -> None:
    base_url = cluster.deploy(
        decode={"num_cpus": 0.25, "autoscaling": SCALING, "drain_timeout_s": 60},
    )
    assert decode_replicas(cluster) == (1, 0)
    before = len(registry_departures())
    timeline: list[tuple[float, int, int]] = []

    async def scenario() -> tuple[Load, Load]:
        start = time.monotonic()
        burst, keepers = Load(base_url), Load(base_url)
        burst_tasks = [asyncio.create_task(burst.loop(i, BURST_TOKENS)) for i in range(BURST)]
        try:
            await watch_until(cluster, 2, timeline, start)
            await asyncio.to_thread(wait_for_target_metric, cluster, 2)
        finally:
            burst.stop.set()
            await asyncio.gather(*burst_tasks)
        # After the burst: a few long streams keep both replicas busy while decode scales
        # back down, so the replica Serve removes has streams in flight when it drains. Once
        # the drain shows, the keepers start no new stream: those in flight (on both replicas,
        # started together) are the ones the drain waits for, so the last ends with it.
        keeper_tasks = [
            asyncio.create_task(keepers.loop(100 + i, KEEPER_TOKENS)) for i in range(KEEPERS)
        ]
        try:
            await watch_until(cluster, 1, timeline, start, on_drain=keepers.stop)
        finally:
            keepers.stop.set()
            await asyncio.gather(*keeper_tasks)
        return burst, keepers

    burst, keepers = asyncio.run(scenario())
    print(f"decode replicas over time (s, taking requests, draining): {timeline}")
    print(
        f"burst: {len(burst.completed)} completed, {len(burst.failures)} failed; "
        f"keepers: {len(keepers.completed)} completed, {len(keepers.failures)} failed"
    )
    assert burst.failures == [] and keepers.failures == []
    assert burst.completed and keepers.completed
    assert max(live for _, live, _ in timeline) == 2 and timeline[-1][1:] == (1, 0)

    departures = [d for d in registry_departures()[before:] if d["role"] == "decode"]
    print(f"decode departures: {departures}")
    assert len(departures) == 1
    drained = departures[0]
    assert drained["waited_for"].get("work calls", 0) >= 1, drained  # streams were in flight
    assert drained["left"] == {}, drained  # and all finished before the replica left
