"""A reservation whose grant the router never handed to a prefill worker (the client left while
decode reserved) is released on decode at once, after its stream is closed; one a prefill worker
may write into is not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.request_timings import RequestTimings
from tests.unit.test_drain import FakeWorker, held_plan, run, start


class SlowDecode(FakeWorker):
    """Answers a reservation once `answer` is set; records closes and releases in order."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.answer = asyncio.Event()
        self.answer.set()
        self.reserving = asyncio.Event()
        self.log: list[str] = []
        self.server.handlers["release_unwritten"] = self.release_unwritten

    async def generate(
        self, local_prefill: bool = False, **kw: Any
    ) -> AsyncIterator[dict[str, Any]]:
        self.reserving.set()
        try:
            await self.answer.wait()
            async for item in super().generate(local_prefill, **kw):
                yield item
        finally:
            self.log.append("closed")

    async def release_unwritten(self, request_id: str) -> AsyncIterator[dict[str, Any]]:
        self.log.append(f"release {request_id}")
        yield {"released_blocks": 1}


async def _settled(decode: SlowDecode, n: int) -> list[str]:
    for _ in range(200):
        if len(decode.log) >= n:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # (nothing more comes)
    return decode.log


def test_a_client_leaving_during_the_reservation_releases_it_after_the_close() -> None:
    async def main() -> None:
        decode, prefill = SlowDecode("d0"), FakeWorker("p0")
        d = await start(decode, prefill, roles="decode prefill")
        decode.answer.clear()
        plan = held_plan(d, "d0", "p0")
        task = asyncio.ensure_future(
            PDOrchestrator(d).reserve(plan, "r1", [1, 2, 3], {}, 0, RequestTimings())
        )
        await decode.reserving.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _settled(decode, 2) == ["closed", "release r1"]
        await d.close()

    asyncio.run(main())


def test_no_release_once_a_prefill_worker_was_handed_the_grant() -> None:
    async def main() -> None:
        decode, prefill = SlowDecode("d0"), FakeWorker("p0")
        d = await start(decode, prefill, roles="decode prefill")
        items = await run(PDOrchestrator(d), held_plan(d, "d0", "p0"))  # to the end
        assert [i["token_ids"] for i in items] == [[0], [1], [2]]
        orchestrator = PDOrchestrator(d)
        plan = held_plan(d, "d0", "p0")
        timings = RequestTimings()
        await orchestrator.reserve(plan, "r2", [1, 2, 3], {}, 0, timings)
        assert plan.grant_handed  # (sent with the `grant` call)
        stream = orchestrator.generate("r2", [1, 2, 3], {}, timings, plan)
        await anext(stream)
        await stream.aclose()  # the client left mid-stream
        assert await _settled(decode, 3) == ["closed", "closed"]
        await d.close()

    asyncio.run(main())


def test_a_refusing_decode_workers_grant_starts_the_prefill_at_once() -> None:
    """While a decode worker refuses reservations the prefill starts only with the grant, as
    soon as `reserve` has it (not when the request runs: the choices of one request run once
    all are granted); the prefill worker may write into it then, so a client that leaves
    leaves its release to that worker."""

    async def main() -> None:
        decode, prefill = SlowDecode("d0"), FakeWorker("p0")
        d = await start(decode, prefill, roles="decode prefill")
        orchestrator = PDOrchestrator(d)
        plan = held_plan(d, "d0", "p0")
        plan.decode.note_reservation(refused=True)
        await orchestrator.reserve(plan, "r3", [1, 2, 3], {}, 0, RequestTimings())
        assert plan.grant is not None and plan.grant_handed
        assert plan.prefill_call is not None and plan.prefill_call.carries_grant
        outcome = await plan.prefill_call.task
        assert (prefill.calls, outcome["grant"]) == (1, plan.grant)
        await orchestrator.abandon(plan, "r3")
        assert await _settled(decode, 1) == ["closed"]
        assert (plan.decode.in_flight, plan.decode.queued_tokens) == (0, 0)
        await d.close()

    asyncio.run(main())
