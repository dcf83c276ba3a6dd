"""A decode worker with no KV room now (its reservation waits, `queued`, or is refused: a
request with a deadline) while another one reported room and nothing waiting: the request moves
there once, instead of waiting its turn or a 429; not when its worker holds a prefix of it, nor
to a worker without room."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem.router.errors import APIError
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.plan_moves import roomy_decoder
from tests.unit.test_decode_full_admission import FullDecode, QueueingDecode, RecordingPrefill
from tests.unit.test_drain import FakeWorker, held_plan, run, start

ROOM = {"num_free_blocks": 100, "num_waiting_reservations": 0}


async def _cluster(d1_stats: dict[str, Any]) -> tuple[Any, QueueingDecode, RecordingPrefill]:
    d0, d1, p0 = QueueingDecode("d0"), FakeWorker("d1"), RecordingPrefill("p0")
    d = await start(d0, d1, p0, roles="decode decode prefill")
    d.workers["d1"].stats = dict(d1_stats)
    return d, d0, p0


def test_a_request_without_room_on_its_decode_worker_moves_to_one_with_room() -> None:
    async def main() -> None:
        d, d0, p0 = await _cluster(ROOM)
        plan = held_plan(d, "d0", "p0")
        items = await run(PDOrchestrator(d), plan)
        assert items[-1]["text"] == "d1" and [i["token_ids"] for i in items] == [[0], [1], [2]]
        assert plan.decoder.worker_id == "d1"
        assert p0.grants == [None]  # its prefill went on, for d1's grant (no second call)
        assert d.workers["d0"].refusing()  # (the next requests reserve before prefilling)
        assert d.workers["d1"].stats["num_free_blocks"] == 100 - plan.prompt_blocks
        loads = {w.worker_id: (w.in_flight, w.queued_tokens) for w in d.workers.values()}
        assert loads == {"d0": (0, 0), "d1": (0, 0), "p0": (0, 0)}
        await d.close()

    asyncio.run(main())


def test_it_waits_on_a_worker_that_holds_its_prefix_or_when_no_other_has_room() -> None:
    async def main() -> None:
        for stats, hits in ((ROOM, 1), ({**ROOM, "num_free_blocks": 0}, 0),
                            ({**ROOM, "num_waiting_reservations": 2}, 0)):  # fmt: skip
            d, d0, p0 = await _cluster(stats)
            plan = held_plan(d, "d0", "p0")
            plan.decode_hit_blocks = hits
            items = await run(PDOrchestrator(d), plan)
            assert items[-1]["text"] == "d0" and plan.decoder.worker_id == "d0"
            assert p0.grants == [None, {"from": "d0"}]  # waited: restarted with the grant
            await d.close()

    asyncio.run(main())


def test_the_roomy_worker_is_the_least_loaded_that_reported_room() -> None:
    async def main() -> None:
        d0, d1, d2 = FakeWorker("d0"), FakeWorker("d1"), FakeWorker("d2")
        d = await start(d0, d1, d2, roles="decode decode decode")
        w0, w1, w2 = (d.workers[w] for w in ("d0", "d1", "d2"))
        w1.stats, w2.stats = dict(ROOM), dict(ROOM)
        w1.in_flight = 3
        assert roomy_decoder([w0, w1, w2], w0, 60) is w2
        assert roomy_decoder([w0, w1, w2], w0, 60) is w1  # (d2 has 40 left: too few)
        assert roomy_decoder([w0, w1, w2], w0, 60) is None
        w2.note_reservation(refused=True)
        w2.stats = dict(ROOM)
        assert roomy_decoder([w0, w1, w2], w0, 60) is None  # (it refused since)
        await d.close()

    asyncio.run(main())


def test_a_request_with_a_deadline_refused_for_room_tries_a_worker_with_room() -> None:
    async def main() -> None:
        for stats in (ROOM, {**ROOM, "num_free_blocks": 0}):
            d0, d1, p0 = FullDecode("d0"), FakeWorker("d1"), FakeWorker("p0")
            d = await start(d0, d1, p0, roles="decode decode prefill")
            d.workers["d1"].stats = dict(stats)
            plan = held_plan(d, "d0", "p0")
            plan.wait_for_room = False
            if stats["num_free_blocks"]:
                items = await run(PDOrchestrator(d), plan)
                assert items[-1]["text"] == "d1" and plan.decoder.worker_id == "d1"
            else:
                with pytest.raises(APIError) as refused:
                    await run(PDOrchestrator(d), plan)
                plan.release()  # (the router's serving layer does, for a refused request)
                assert (refused.value.status, refused.value.code) == (429, "decode_full")
            loads = {w.worker_id: (w.in_flight, w.queued_tokens) for w in d.workers.values()}
            assert loads == {"d0": (0, 0), "d1": (0, 0), "p0": (0, 0)}
            await d.close()

    asyncio.run(main())
