"""A prefill worker that dies while its request waits for decode's grant: the request takes
another prefill worker with the grant; and a grant whose prefill call never reached a worker is
released on decode at once (decode need not hold the blocks for pages that cannot come)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.router.errors import WorkerLost
from tandem.router.pd_orchestrator import PDOrchestrator
from tests.unit.test_decode_full_admission import QueueingDecode, RecordingPrefill
from tests.unit.test_drain import FakeWorker, held_plan, run, start


def test_a_request_whose_prefill_worker_died_while_it_waited_for_room_takes_another() -> None:
    async def main() -> None:
        decode = QueueingDecode("d0")  # queued, then granted 50 ms later
        p0, p1 = RecordingPrefill("p0"), RecordingPrefill("p1")
        d = await start(decode, p0, p1, roles="decode prefill prefill")
        plan = held_plan(d, "d0", "p0")

        async def p0_dies() -> None:
            await asyncio.sleep(0.02)  # (while the reservation waits)
            await d.workers["p0"].client.abandon("died")

        death = asyncio.create_task(p0_dies())
        items = await run(PDOrchestrator(d), plan)
        await death
        assert [i["token_ids"] for i in items] == [[0], [1], [2]]
        assert plan.prefill is not None and plan.prefill.worker_id == "p1"
        assert p0.grants == [None]  # its early call, stopped when decode said "queued"
        assert p1.grants == [{"from": "d0"}]  # the restart, with the grant
        loads = {w.worker_id: (w.in_flight, w.queued_tokens) for w in d.workers.values()}
        assert loads == {"d0": (0, 0), "p0": (0, 0), "p1": (0, 0)}
        await d.close()

    asyncio.run(main())


class ReleasingDecode(FakeWorker):
    """Records `release_unwritten` calls (the router's word that no page will come)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.released: list[str] = []
        self.server.handlers["release_unwritten"] = self.release_unwritten

    async def release_unwritten(self, request_id: str) -> AsyncIterator[dict[str, Any]]:
        self.released.append(request_id)
        yield {"released": 1}


def test_a_grant_whose_prefill_call_never_reached_a_worker_is_released_at_once() -> None:
    async def main() -> None:
        decode, p0 = ReleasingDecode("d0"), FakeWorker("p0")
        d = await start(decode, p0, roles="decode prefill")
        await p0.server.close()  # p0 is gone before the router ever connected
        plan = held_plan(d, "d0", "p0")
        plan.decoder.note_reservation(refused=True)  # (the prefill call waits for the grant)
        with pytest.raises(WorkerLost):
            await run(PDOrchestrator(d), plan)
        assert decode.released == ["r1"]
        await d.close()

    asyncio.run(main())


class HangingDecode(FakeWorker):
    """Grants, then streams nothing (its process is about to die)."""

    async def generate(self, **_: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "grant", "grant": {"from": self.worker_id}}
        await asyncio.sleep(60)


class FailingPrefill(FakeWorker):
    """Its transfer fails: the decode worker it sent to is gone (its transport saw it first)."""

    async def prefill(self, grant: dict[str, Any], **_: Any) -> AsyncIterator[dict[str, Any]]:
        await asyncio.sleep(0.02)
        yield {"status": "failed", "first_token_ids": [], "error": "connection lost"}


def test_a_prefill_that_fails_because_its_decode_worker_died_is_that_workers_loss() -> None:
    """The request then starts over without the dead decode worker (a `WorkerLost` for it),
    rather than failing with a 503 from a prefill worker that is fine."""

    async def main() -> None:
        d = await start(HangingDecode("d0"), FailingPrefill("p0"), roles="decode prefill")

        async def d0_dies() -> None:
            await asyncio.sleep(0.1)  # (after the prefill's failure reached the router)
            await d.workers["d0"].client.abandon("died")

        death = asyncio.create_task(d0_dies())
        with pytest.raises(WorkerLost) as lost:
            await run(PDOrchestrator(d), held_plan(d, "d0", "p0"))
        await death
        assert (lost.value.worker_id, lost.value.code) == ("d0", "decode_failed")
        await d.close()

    asyncio.run(main())
