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
from tandem.router.worker_directory import WorkerDirectory
from tests.unit.test_decode_full_admission import QueueingDecode, RecordingPrefill
from tests.unit.test_drain import FakeWorker, held_plan, run, start


def dies_after(d: WorkerDirectory, worker_id: str, seconds: float) -> asyncio.Task[None]:
    """The router loses its connection to `worker_id` after `seconds` (as when it dies)."""

    async def dies() -> None:
        await asyncio.sleep(seconds)
        await d.workers[worker_id].client.abandon("died")

    return asyncio.create_task(dies())


def test_a_request_whose_prefill_worker_died_while_it_waited_for_room_takes_another() -> None:
    async def main() -> None:
        decode = QueueingDecode("d0")  # queued, then granted 50 ms later
        p0, p1 = RecordingPrefill("p0"), RecordingPrefill("p1")
        d = await start(decode, p0, p1, roles="decode prefill prefill")
        plan = held_plan(d, "d0", "p0")

        death = dies_after(d, "p0", 0.02)  # (while the reservation waits)
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

        death = dies_after(d, "d0", 0.1)  # (after the prefill's failure reached the router)
        with pytest.raises(WorkerLost) as lost:
            await run(PDOrchestrator(d), held_plan(d, "d0", "p0"))
        await death
        assert (lost.value.worker_id, lost.value.code) == ("d0", "decode_failed")
        await d.close()

    asyncio.run(main())


class HoldingDecode(HangingDecode):
    """Grants, streams nothing; records the router's releases of held blocks."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.releases: list[tuple[str, dict[str, Any]]] = []
        self.server.handlers["release_unwritten"] = self.release_unwritten
        self.server.handlers["release_from_lost_sender"] = self.release_from_lost_sender

    async def release_unwritten(self, **args: Any) -> AsyncIterator[dict[str, Any]]:
        self.releases.append(("release_unwritten", args))
        yield {"released_blocks": 0}

    async def release_from_lost_sender(self, **args: Any) -> AsyncIterator[dict[str, Any]]:
        self.releases.append(("release_from_lost_sender", args))
        yield {"released_blocks": 0}


class HangingPrefill(FakeWorker):
    """Takes the grant and computes for ever (its process is about to die)."""

    async def prefill(self, grant: dict[str, Any], **_: Any) -> AsyncIterator[dict[str, Any]]:
        await asyncio.sleep(60)
        yield {}


def test_a_request_whose_prefill_worker_is_lost_after_the_grant_names_it_to_decode() -> None:
    """Decode holds the blocks of a reservation that ends before its pages came, in case its
    sender still writes them; told which lost prefill worker had the grant (its KV address),
    it frees them once its transport confirms that worker's process is gone."""

    async def main() -> None:
        decode = HoldingDecode("d0")
        d = await start(decode, HangingPrefill("p0"), roles="decode prefill")
        d.workers["p0"].stats = {"role": "prefill", "address": "shm:/tmp/tandem-kv-p0.sock"}

        death = dies_after(d, "p0", 0.1)  # (computing, with the grant)
        with pytest.raises(WorkerLost) as lost:
            await run(PDOrchestrator(d), held_plan(d, "d0", "p0"))
        await death
        assert (lost.value.worker_id, lost.value.code) == ("p0", "prefill_failed")
        assert decode.releases == [
            (
                "release_from_lost_sender",
                {"request_id": "r1", "sender": "shm:/tmp/tandem-kv-p0.sock"},
            )
        ]
        await d.close()

    asyncio.run(main())


def test_a_prefill_worker_known_lost_is_not_blamed_on_decode_after_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its call failed because its connection is gone: the request starts over at once,
    without first waiting `PEER_LOSS_S` for the live decode worker to turn out dead (each
    request on a killed prefill worker started over ~0.5 s late)."""
    from tandem.router import worker_failures

    monkeypatch.setattr(worker_failures, "PEER_LOSS_S", 30.0)

    async def main() -> None:
        d = await start(HoldingDecode("d0"), HangingPrefill("p0"), roles="decode prefill")
        death = dies_after(d, "p0", 0.1)
        with pytest.raises(WorkerLost) as lost:
            await asyncio.wait_for(run(PDOrchestrator(d), held_plan(d, "d0", "p0")), 10)
        await death
        assert (lost.value.worker_id, lost.value.code) == ("p0", "prefill_failed")
        await d.close()

    asyncio.run(main())


def test_no_release_when_the_prefill_worker_with_the_grant_is_alive() -> None:
    """A client that leaves: decode's blocks wait for that worker's own word (its cancel)."""

    async def main() -> None:
        decode = HoldingDecode("d0")
        d = await start(decode, HangingPrefill("p0"), roles="decode prefill")
        d.workers["p0"].stats = {"role": "prefill", "address": "shm:/tmp/tandem-kv-p0.sock"}
        task = asyncio.ensure_future(run(PDOrchestrator(d), held_plan(d, "d0", "p0")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert decode.releases == []
        await d.close()

    asyncio.run(main())


class SenderGoneDecode(FakeWorker):
    """Grants, then its transport reports the prefill worker's process ended mid-transfer."""

    async def generate(self, **_: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "grant", "grant": {"from": self.worker_id}}
        await asyncio.sleep(0.05)
        yield {"type": "error", "code": "sender_gone", "error": "its sender is gone"}


def test_decode_saying_the_sender_is_gone_before_the_router_sees_it_is_that_workers_loss() -> None:
    """Decode's transport may learn of the prefill worker's death a moment before the router
    loses its connection: the request then starts over without that worker (`WorkerLost`),
    rather than failing with decode's 503."""

    async def main() -> None:
        d = await start(SenderGoneDecode("d0"), HangingPrefill("p0"), roles="decode prefill")
        death = dies_after(d, "p0", 0.2)  # (after decode's word reached the router)
        with pytest.raises(WorkerLost) as lost:
            await run(PDOrchestrator(d), held_plan(d, "d0", "p0"))
        await death
        assert (lost.value.worker_id, lost.value.code) == ("p0", "prefill_failed")
        await d.close()

    asyncio.run(main())


class SlowOutcomePrefill(FakeWorker):
    """Its outcome ("sent") comes late, as under load, after decode already streams."""

    async def prefill(self, grant: dict[str, Any], **_: Any) -> AsyncIterator[dict[str, Any]]:
        self.calls += 1
        await asyncio.sleep(1.0)
        yield {"status": "sent", "first_token_ids": [], "timings": {}, "grant": grant}


def test_a_prefill_worker_lost_once_decode_streams_its_own_tokens_costs_nothing() -> None:
    """Decode's own tokens come once every page is there: the prefill worker's death after
    that is no loss to the request (it was started over, spending its one retry)."""

    async def main() -> None:
        decode, p0 = FakeWorker("d0", tokens=6), SlowOutcomePrefill("p0")
        d = await start(decode, p0, roles="decode prefill")
        plan = held_plan(d, "d0", "p0")
        death = dies_after(d, "p0", 0.035)  # (after decode's first tokens, before its last)
        items = await run(PDOrchestrator(d), plan)
        await death
        assert [i["token_ids"] for i in items] == [[i] for i in range(6)]
        assert (decode.calls, p0.calls) == (1, 1)
        await d.close()

    asyncio.run(main())


class QueueingReleasingDecode(QueueingDecode, ReleasingDecode):
    """Queues, then grants; records the router's word that no page will come."""


def test_a_granted_request_whose_only_prefill_worker_died_while_it_waited_releases_its_grant() -> (
    None
):
    """No other prefill worker to take it: the request starts over (a `WorkerLost` that the
    router's start-over takes), and the grant nobody was handed goes back on decode at once,
    not when its lease runs out."""

    async def main() -> None:
        decode, p0 = QueueingReleasingDecode("d0"), RecordingPrefill("p0")
        d = await start(decode, p0, roles="decode prefill")
        plan = held_plan(d, "d0", "p0")
        death = dies_after(d, "p0", 0.02)  # (while the reservation waits)
        with pytest.raises(WorkerLost) as lost:
            await run(PDOrchestrator(d), plan)
        await death
        assert (lost.value.worker_id, lost.value.code, lost.value.drained) == (
            "p0",
            "prefill_failed",
            True,
        )
        assert decode.released == ["r1"]
        assert p0.grants == [None]  # its early call only: nothing started with the grant
        await d.close()

    asyncio.run(main())
