"""The prefill queue a decode worker holds for the prompts it prefills itself (colocated mode,
a short uncached tail), through the orchestrator over real RPC: released at decode's first
token (not the request's end), and at the end of a request that failed before it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tandem.engine.hashing import root_hash
from tandem.router.admission import AdmissionConfig
from tandem.router.errors import APIError
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.request_timings import RequestTimings
from tandem.router.route_planner import DecodeRoutingConfig, RoutePlanner
from tandem.router.routing_policy import RoutingConfig
from tandem.router.worker_directory import WorkerDirectory
from tests.unit.test_drain import FakeWorker, start

INFO = {"block_size": 16, "namespace": "ns", "root_hash": root_hash("ns")}


class FailingWorker(FakeWorker):
    """A decode worker whose prefill fails: an error item before any token."""

    async def generate(
        self, local_prefill: bool = False, **_: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.calls += 1
        yield {"type": "error", "code": "internal_error", "error": "boom"}


def queued(d: WorkerDirectory) -> list[tuple[int, int, int]]:
    return [(w.queued_prefill_tokens, w.in_flight, w.queued_tokens) for w in d.workers.values()]


async def run(d: WorkerDirectory, prompt: list[int]) -> list[list[tuple[int, int, int]]]:
    """Each item's view of the load, as the request's items come."""
    planner = RoutePlanner(
        d, RoutingConfig(), DecodeRoutingConfig(), AdmissionConfig(), colocated=True
    )
    plan = await planner.plan(prompt, INFO, None, 60, 3)
    assert queued(d) == [(300, 1, 303)]
    orchestrator, timings = PDOrchestrator(d), RequestTimings()
    await orchestrator.reserve(plan, "r", prompt, {}, 0, timings)
    return [queued(d) async for _ in orchestrator.generate("r", prompt, {}, timings, plan)]


def test_a_local_prefill_leaves_the_queue_at_its_first_token() -> None:
    async def main() -> None:
        d = await start(FakeWorker("d0", tokens=3), roles="decode")
        seen = await run(d, list(range(300)))
        assert seen[0] == [(0, 1, 303)]  # (prefilled: still decoding)
        assert queued(d) == [(0, 0, 0)]
        await d.close()

    asyncio.run(main())


def test_a_local_prefill_that_failed_leaves_the_queue() -> None:
    async def main() -> None:
        d = await start(FailingWorker("d0"), roles="decode")
        try:
            await run(d, list(range(300)))
        except APIError as exc:
            assert exc.status == 500
        else:
            raise AssertionError("the failure did not reach the caller")
        assert queued(d) == [(0, 0, 0)]
        await d.close()

    asyncio.run(main())
