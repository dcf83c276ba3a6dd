"""Draining without Ray: the worker side (tracked calls, refusals, the bounded wait) and the
router side (a refused request moves to another worker; a draining worker's connection stays
open for the requests it still serves)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.engine.recent_mean import RecentMean
from tandem.engine.rpc import RPCClient, RPCServer
from tandem.engine.worker_drain import DRAINING, WorkTracker, drain
from tandem.router.errors import APIError
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.request_timings import RequestTimings
from tandem.router.route_planner import RoutePlan
from tandem.router.worker_directory import Worker, WorkerDirectory

TOKEN = "secret"


class FakeWorker:
    """A worker's RPC surface: `generate` (decode) and `prefill`, tracked like the real ones."""

    def __init__(self, worker_id: str, tokens: int = 3) -> None:
        self.worker_id = worker_id
        self.tokens = tokens
        self.work = WorkTracker()
        self.calls = 0
        self.server = RPCServer(
            {
                "generate": self.work.wrap(self.generate, self.refuse_generate),
                "prefill": self.work.wrap(self.prefill, self.refuse_prefill),
                "info": self.info,
            },
            TOKEN,
        )

    async def info(self) -> AsyncIterator[dict[str, Any]]:
        yield {"from": self.worker_id}

    def refuse_generate(self) -> dict[str, Any]:
        return {"type": "error", "code": DRAINING, "error": f"{self.worker_id} is draining"}

    def refuse_prefill(self) -> dict[str, Any]:
        return {"status": "failed", "code": DRAINING, "first_token_ids": [], "error": "draining"}

    async def generate(
        self, local_prefill: bool = False, **_: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.calls += 1
        if not local_prefill:
            yield {"type": "grant", "grant": {"from": self.worker_id}}
        for i in range(self.tokens):
            await asyncio.sleep(0.01)
            last = i == self.tokens - 1
            yield {
                "type": "tokens",
                "token_ids": [i],
                "text": self.worker_id if last else "",
                "finish_reason": "length" if last else None,
            }

    async def prefill(self, grant: dict[str, Any], **_: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls += 1
        yield {"status": "sent", "first_token_ids": [], "timings": {}, "grant": grant}


async def start(*workers: FakeWorker, roles: str) -> WorkerDirectory:
    d = WorkerDirectory(registry=None, auth_token=TOKEN)
    for worker, role in zip(workers, roles.split(), strict=True):
        address = await worker.server.start()
        d.workers[worker.worker_id] = Worker(worker.worker_id, role, RPCClient(address, TOKEN))
    return d


def held_plan(d: WorkerDirectory, decode: str, prefill: str | None) -> RoutePlan:
    plan = RoutePlan(
        d.workers[decode], d.workers[prefill] if prefill else None, 1, 0, 0, 10, decode_tokens=20
    )
    for worker, tokens in ((plan.decode, 20), (plan.prefill, 10)):
        if worker is not None:
            worker.in_flight += 1
            worker.queued_tokens += tokens
    return plan


async def run(orchestrator: PDOrchestrator, plan: RoutePlan) -> list[dict[str, Any]]:
    timings = RequestTimings()
    await orchestrator.reserve(plan, "r1", [1, 2, 3], {}, 0, timings)
    return [item async for item in orchestrator.generate("r1", [1, 2, 3], {}, timings, plan)]


def test_a_request_refused_by_draining_workers_moves_to_others() -> None:
    async def main() -> None:
        d0, d1, p0, p1 = FakeWorker("d0"), FakeWorker("d1"), FakeWorker("p0"), FakeWorker("p1")
        d = await start(d0, d1, p0, p1, roles="decode decode prefill prefill")
        d0.work.draining = p0.work.draining = True  # the router does not know yet
        plan = held_plan(d, "d0", "p0")
        items = await run(PDOrchestrator(d), plan)
        assert [i["token_ids"] for i in items] == [[0], [1], [2]]
        assert items[-1]["text"] == "d1"  # decoded by the worker that took it
        assert (plan.decode.worker_id, plan.prefill and plan.prefill.worker_id) == ("d1", "p1")
        assert [w.worker_id for w in d.live("decode") + d.live("prefill")] == ["d1", "p1"]
        assert (d0.calls, p0.calls, d1.calls, p1.calls) == (0, 0, 1, 1)
        loads = {w.worker_id: (w.in_flight, w.queued_tokens) for w in d.workers.values()}
        assert loads == {w: (0, 0) for w in ("d0", "d1", "p0", "p1")}  # moved, then released
        await d.close()

    asyncio.run(main())


def test_a_local_prefill_refused_by_a_draining_worker_moves_too() -> None:
    async def main() -> None:
        d0, d1 = FakeWorker("d0"), FakeWorker("d1")
        d = await start(d0, d1, roles="decode decode")
        d0.work.draining = True
        plan = held_plan(d, "d0", None)
        items = await run(PDOrchestrator(d), plan)
        assert items[-1]["text"] == "d1" and len(items) == 3
        assert d.workers["d0"].draining and (d0.calls, d1.calls) == (0, 1)
        await d.close()

    asyncio.run(main())


def test_the_drain_waits_for_tracked_calls_and_refuses_new_ones() -> None:
    async def main() -> None:
        worker = FakeWorker("d0", tokens=30)
        d = await start(worker, roles="decode")
        client = d.workers["d0"].client
        stream = client.stream("generate", local_prefill=True)
        first = await anext(stream)
        assert worker.work.in_flight == 1 and first["type"] == "tokens"
        worker.work.draining = True
        refused = await client.call("generate", local_prefill=True)
        assert refused["code"] == DRAINING

        async def counts() -> dict[str, int]:
            return {"work calls": worker.work.in_flight}

        draining = asyncio.ensure_future(drain("d0", counts, timeout_s=10, min_s=0))
        rest = [item async for item in stream]  # the stream in flight finishes whole
        report = await draining
        assert len(rest) == 29 and rest[-1]["finish_reason"] == "length"
        assert report.waited_for == {"work calls": 1} and report.left == {}
        await d.close()

    asyncio.run(main())


def test_the_drain_gives_up_at_its_timeout_and_says_what_was_left() -> None:
    async def stuck() -> dict[str, int]:
        return {"requests": 2, "transfers": 0}

    report = asyncio.run(drain("p0", stuck, timeout_s=0.2, poll_s=0.02, min_s=0))
    assert report.waited_for == report.left == {"requests": 2}
    assert 0.2 <= report.seconds < 2


class FakeRegistry:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        outer = self

        class _List:
            @staticmethod
            async def remote(max_age_s: float) -> list[dict[str, Any]]:
                return outer.entries

        self.list = _List()


def test_the_directory_keeps_a_draining_workers_connection_for_its_requests() -> None:
    async def main() -> None:
        registry = FakeRegistry()
        d = WorkerDirectory(registry, TOKEN)
        registry.entries = [
            {"worker_id": "decode/a", "role": "decode", "rpc_address": "127.0.0.1:1"},
            {"worker_id": "decode/b", "role": "decode", "rpc_address": "127.0.0.1:2"},
        ]
        await d.refresh()
        a = d.workers["decode/a"]
        a.in_flight = 1  # a request this router routed there is still streaming
        registry.entries[0] = {**registry.entries[0], "draining": True}
        await d.refresh()
        assert [w.worker_id for w in d.live("decode")] == ["decode/b"] and a.draining
        registry.entries = registry.entries[1:]  # drained and gone from the registry
        await d.refresh()
        assert "decode/a" not in d.workers and not a.client.closed  # still in use
        a.in_flight = 0
        await d.refresh()
        assert a.client.closed
        await d.close()

    asyncio.run(main())


def test_a_worker_that_stops_reporting_mid_request_is_given_up() -> None:
    """A hung worker (no report, not draining) keeps its connection open: the calls on it fail
    as from a lost worker (`lost_at` set), so the router takes its requests elsewhere."""

    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        registry = FakeRegistry()
        d = WorkerDirectory(registry, TOKEN)
        registry.entries = [
            {"worker_id": "decode/a", "role": "decode", "rpc_address": f"127.0.0.1:{port}"}
        ]
        await d.refresh()
        a = d.workers["decode/a"]
        a.in_flight = 1
        a.client._queues[7] = waiting = asyncio.Queue()  # a call in flight on it
        registry.entries = []  # its entry aged out: it stopped reporting
        await d.refresh()
        assert a.client.closed and a.client.lost_at is not None
        assert "stopped answering" in (await waiting.get())["error"]
        server.close()
        await d.close()

    asyncio.run(main())


def test_the_directory_does_not_bring_back_a_lost_worker_until_it_reports_again() -> None:
    """A worker whose connection broke is taken for dead: it stays out of the live set (its
    registry entry lingers for seconds) until it reports again."""

    async def main() -> None:
        registry = FakeRegistry()
        d = WorkerDirectory(registry, TOKEN)
        entry = {"worker_id": "prefill/a", "role": "prefill", "rpc_address": "127.0.0.1:1",
                 "reported_at": 100.0}  # fmt: skip
        registry.entries = [
            entry,
            {**entry, "worker_id": "prefill/b", "rpc_address": "127.0.0.1:2"},
        ]
        await d.refresh()
        a = d.workers["prefill/a"]
        a.client.closed, a.client.lost_at = True, 50.0  # broke (the registry's clock differs)
        for _ in range(2):
            await d.refresh()
            assert [w.worker_id for w in d.live("prefill")] == ["prefill/b"]
            assert d.workers["prefill/a"] is a  # kept (its requests' load), not reconnected
        registry.entries[0] = {**entry, "reported_at": 102.0}  # alive after all
        await d.refresh()
        assert sorted(w.worker_id for w in d.live("prefill")) == ["prefill/a", "prefill/b"]
        assert d.workers["prefill/a"] is not a  # a fresh connection
        await d.close()

    asyncio.run(main())


def test_recent_mean_forgets_old_samples() -> None:
    now = [0.0]
    mean = RecentMean(window_s=5.0, clock=lambda: now[0])
    assert mean.mean() == 0.0
    mean.add(10.0)
    mean.add(40.0, weight=2)
    assert mean.mean() == 30.0
    now[0] = 6.0
    assert mean.mean() == 0.0  # idle: no latency to report


def test_requests_waiting_for_a_worker_fail_at_once_when_the_router_stops() -> None:
    """A request that came in as the app shut down (its workers already gone) waited the whole
    30 s for a worker that would not come, and held the router replica's stop as long."""

    async def main() -> None:
        d = WorkerDirectory(FakeRegistry(), TOKEN)
        d.start()  # (no worker registered)
        waiting = asyncio.ensure_future(d.wait_for("decode", timeout=30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        start = asyncio.get_running_loop().time()
        d.stop_waiting()
        with pytest.raises(APIError) as err:
            await waiting
        assert err.value.status == 503 and asyncio.get_running_loop().time() - start < 1.0
        with pytest.raises(APIError):  # and one arriving later does not wait either
            await asyncio.wait_for(d.wait_for("decode", timeout=30.0), 1.0)
        await d.close()

    asyncio.run(main())
