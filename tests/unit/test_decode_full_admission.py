"""A decode worker without KV room refuses reservations (429 `decode_full`). The first refusal
ran its prefill in parallel, for nothing; while that worker keeps refusing, the router reserves
first and starts no prefill. Its first grant puts prefill and reservation back in parallel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.router.errors import APIError
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.request_timings import RequestTimings
from tests.unit.test_drain import FakeWorker, held_plan, run, start


class FullDecode(FakeWorker):
    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.full = True

    async def generate(
        self, local_prefill: bool = False, **kw: Any
    ) -> AsyncIterator[dict[str, Any]]:
        if self.full:
            yield {"type": "error", "code": "no_capacity", "error": "no free blocks"}
            return
        async for item in super().generate(local_prefill, **kw):
            yield item


class RecordingPrefill(FakeWorker):
    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.grants: list[dict[str, Any] | None] = []  # the grant each prefill call came with

    async def prefill(self, grant: dict[str, Any], **kw: Any) -> AsyncIterator[dict[str, Any]]:
        self.grants.append(grant)
        async for item in super().prefill(grant, **kw):
            yield item


def test_a_refusing_decode_worker_gets_reservations_before_prefill_work() -> None:
    async def main() -> None:
        decode, prefill = FullDecode("d0"), RecordingPrefill("p0")
        d = await start(decode, prefill, roles="decode prefill")
        orchestrator = PDOrchestrator(d)
        for _ in range(3):
            plan = held_plan(d, "d0", "p0")
            with pytest.raises(APIError) as refused:
                await run(orchestrator, plan)
            plan.release()  # (the router's serving layer does, for a refused request)
            assert (refused.value.status, refused.value.code) == (429, "decode_full")
        await asyncio.sleep(0.05)
        assert prefill.grants == [None]  # only the first refusal started a prefill
        decode.full = False
        items = await run(orchestrator, held_plan(d, "d0", "p0"))
        assert [i["token_ids"] for i in items] == [[0], [1], [2]]
        assert prefill.grants == [None, {"from": "d0"}]  # started with its grant
        await run(orchestrator, held_plan(d, "d0", "p0"))
        assert prefill.grants[2] is None  # granted again: in parallel again
        loads = {w.worker_id: (w.in_flight, w.queued_tokens) for w in d.workers.values()}
        assert loads == {"d0": (0, 0), "p0": (0, 0)}
        await d.close()

    asyncio.run(main())


class QueueingDecode(FakeWorker):
    """No KV room now: the reservation waits (`queued`), then is granted or ends `then`."""

    def __init__(self, worker_id: str, then: str = "grant") -> None:
        super().__init__(worker_id)
        self.then = then
        self.wait_for_room: list[bool] = []

    async def generate(
        self, local_prefill: bool = False, wait_for_room: bool = True, **kw: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.wait_for_room.append(wait_for_room)
        yield {"type": "queued"}
        await asyncio.sleep(0.05)
        if self.then != "grant":
            yield {"type": "error", "code": self.then, "error": f"{self.worker_id}: {self.then}"}
            return
        async for item in super().generate(local_prefill, **kw):
            yield item


def test_a_waiting_reservation_is_awaited_and_its_prefill_starts_with_the_grant() -> None:
    async def main() -> None:
        decode, prefill = QueueingDecode("d0"), RecordingPrefill("p0")
        d = await start(decode, prefill, roles="decode prefill")
        orchestrator = PDOrchestrator(d)
        for _ in range(2):
            items = await run(orchestrator, held_plan(d, "d0", "p0"))
            assert [i["token_ids"] for i in items] == [[0], [1], [2]]
        # the first started its prefill in parallel: stopped when decode said it queues, and
        # started again with its grant; the next one's prefill waited for its grant (no
        # prefill pages held for a reservation that waits for room)
        assert prefill.grants == [None, {"from": "d0"}, {"from": "d0"}]
        plan = held_plan(d, "d0", "p0")
        plan.wait_for_room = False  # (a request with a deadline: the decode worker refuses)
        await run(orchestrator, plan)
        assert decode.wait_for_room == [True, True, False]
        await d.close()

    asyncio.run(main())


def test_a_waiting_reservation_refused_by_a_draining_worker_moves_to_another() -> None:
    async def main() -> None:
        d0, d1, p0 = QueueingDecode("d0", then="draining"), FakeWorker("d1"), FakeWorker("p0")
        d = await start(d0, d1, p0, roles="decode decode prefill")
        plan = held_plan(d, "d0", "p0")
        items = await run(PDOrchestrator(d), plan)
        assert items[-1]["text"] == "d1"
        assert plan.decoder.worker_id == "d1"
        await d.close()

    asyncio.run(main())


class GrantTakingPrefill(FakeWorker):
    """A prefill worker whose prefill runs until cancelled, and that records the grants that
    reach it (`grant` RPC, answered after a moment)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.server.handlers["grant"] = self.grant
        self.granted: list[str] = []

    async def prefill(self, grant: dict[str, Any], **kw: Any) -> AsyncIterator[dict[str, Any]]:
        await asyncio.sleep(60)
        yield {}

    async def grant(self, request_id: str, grant: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        await asyncio.sleep(0.05)
        self.granted.append(request_id)
        yield {"ok": False, "error": "ended before its reservation came"}


def test_a_grant_on_its_way_reaches_the_prefill_worker_though_the_request_ended() -> None:
    """The client leaves right after decode reserved: the router closes the prefill call but
    lets the grant's hand-over finish, so the prefill worker can tell decode to free the
    blocks at once (a cancelled hand-over left them held for decode's stall timeout)."""

    async def main() -> None:
        decode, prefill = FakeWorker("d0"), GrantTakingPrefill("p0")
        d = await start(decode, prefill, roles="decode prefill")
        orchestrator = PDOrchestrator(d)
        plan = held_plan(d, "d0", "p0")
        await orchestrator.reserve(plan, "r1", [1, 2, 3], {}, 0, RequestTimings())
        assert plan.grant_handed
        await orchestrator.abandon(plan, "r1")
        await asyncio.sleep(0.3)
        assert prefill.granted == ["r1"]
        await d.close()

    asyncio.run(main())
