"""A one-token request (max_tokens=1) is planned for its prefill worker alone and ends there:
no decode worker is chosen (none need be live), decode gets no call, holds no load, and its
admission cap does not apply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.router.errors import APIError
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.request_timings import RequestTimings
from tandem.router.route_planner import RoutePlan
from tests.unit.test_drain import FakeWorker, start
from tests.unit.test_route_planner import INFO, WORKERS, directory, planner, publish


def _plan(p: Any, prompt: list[int], max_tokens: int) -> Any:
    async def main() -> Any:
        return await p.plan(prompt, INFO, None, hold_s=60, max_tokens=max_tokens)

    return asyncio.run(main())


def test_a_one_token_request_is_planned_for_prefill_alone() -> None:
    d = directory(*WORKERS)
    history = list(range(10, 210))
    publish(d, "d0", history)  # a tail short enough to stay on d0, were it decoded
    route = _plan(planner(d), history + list(range(300, 310)), max_tokens=1)
    assert route.prefill_only and route.prefill is not None and route.decode is None
    assert route.decode_tokens == 0 and route.prefill.in_flight == 1
    assert all(
        (w.in_flight, w.queued_tokens) == (0, 0) for w in d.workers.values() if w.role == "decode"
    )
    route.release()
    assert all((w.in_flight, w.queued_tokens) == (0, 0) for w in d.workers.values())
    two = _plan(planner(d), history + list(range(300, 310)), max_tokens=2)
    assert not two.prefill_only and two.local_prefill and two.decoder.worker_id == "d0"
    assert two.decoder.in_flight == 1


def test_a_one_token_request_needs_no_live_decode_worker() -> None:
    d = directory(*(w for w in WORKERS if w[1] == "prefill"))
    d.stop_waiting()  # (a role with no live worker is refused at once, not after a wait)
    p = planner(d)
    with pytest.raises(APIError) as refused:
        _plan(p, list(range(50)), max_tokens=2)
    assert (refused.value.status, refused.value.code) == (503, "no_decode_worker")
    route = _plan(p, list(range(50)), max_tokens=1)
    assert route.prefill_only and route.decode is None and route.prefill.worker_id == "p0"
    route.release()
    assert all((w.in_flight, w.queued_tokens) == (0, 0) for w in d.workers.values())


def test_the_decode_cap_does_not_refuse_a_one_token_request() -> None:
    d = directory(*WORKERS)
    for w in d.workers.values():
        if w.role == "decode":
            w.queued_tokens = 1000
    p = planner(d, max_decode_tokens=1000)
    with pytest.raises(APIError) as refused:
        _plan(p, list(range(50)), max_tokens=2)
    assert refused.value.code == "decode_queue_full"
    assert _plan(p, list(range(50)), max_tokens=1).prefill_only


class FinishingPrefill(FakeWorker):
    """A prefill worker that ends one-token requests itself (refusing `refusals` first)."""

    def __init__(self, worker_id: str, refusals: int = 0, error: str | None = None) -> None:
        super().__init__(worker_id)
        self.refusals = refusals
        self.error = error
        self.finish_here: list[bool] = []

    async def prefill(self, grant: dict[str, Any], **kw: Any) -> AsyncIterator[dict[str, Any]]:
        self.finish_here.append(bool(kw.get("finish_here")))
        if self.refusals:
            self.refusals -= 1
            yield self.refuse_prefill()
            return
        if self.error is not None:
            yield {"status": "failed", "first_token_ids": [], "error": self.error}
            return
        item = {"type": "tokens", "token_ids": [7], "text": self.worker_id}
        item |= {"finish_reason": "length", "num_cached_tokens": 16, "timings": {"prefill_s": 0.01}}
        yield {"status": "finished", "first_token_ids": [7], "item": item}


def one_token_plan(d: Any, prefill: str) -> RoutePlan:
    """As the planner makes it: no decode worker, load held on the prefill worker only."""
    plan = RoutePlan(None, d.workers[prefill], 1, 0, 0, 10)
    plan.prefill.in_flight += 1
    plan.prefill.queued_tokens += 10
    return plan


def test_a_one_token_request_ends_on_its_prefill_worker() -> None:
    async def main() -> None:
        decode, p0, p1 = (
            FakeWorker("d0"),
            FinishingPrefill("p0", refusals=1),
            FinishingPrefill("p1"),
        )
        d = await start(decode, p0, p1, roles="decode prefill prefill")
        orchestrator = PDOrchestrator(d)
        plan = one_token_plan(d, "p0")
        timings = RequestTimings()
        await orchestrator.reserve(plan, "one", [1, 2, 3], {"max_tokens": 1}, 0, timings)
        items = [i async for i in orchestrator.generate("one", [1, 2, 3], {}, timings, plan)]
        assert [(i["token_ids"], i["text"], i["finish_reason"]) for i in items] == [
            ([7], "p1", "length")  # p0 was draining: the request moved to p1
        ]
        assert decode.calls == 0 and p0.finish_here == p1.finish_here == [True]
        assert timings.stages_ms()["prefill"] == 10.0
        assert all((w.in_flight, w.queued_tokens) == (0, 0) for w in d.workers.values())
        await d.close()

    asyncio.run(main())


def test_a_failed_one_token_request_is_a_503() -> None:
    async def main() -> None:
        decode, p0 = FakeWorker("d0"), FinishingPrefill("p0", error="step failed")
        d = await start(decode, p0, roles="decode prefill")
        plan = one_token_plan(d, "p0")
        orchestrator, timings = PDOrchestrator(d), RequestTimings()
        await orchestrator.reserve(plan, "one", [1, 2, 3], {}, 0, timings)
        with pytest.raises(APIError) as failed:
            [i async for i in orchestrator.generate("one", [1, 2, 3], {}, timings, plan)]
        assert (failed.value.status, failed.value.code) == (503, "prefill_failed")
        assert "prefill failed: step failed" in str(failed.value)
        assert all((w.in_flight, w.queued_tokens) == (0, 0) for w in d.workers.values())
        await d.close()

    asyncio.run(main())


def test_a_one_token_request_is_served_with_no_decode_worker_at_all() -> None:
    async def main() -> None:
        p0 = FinishingPrefill("p0")
        d = await start(p0, roles="prefill")
        plan = one_token_plan(d, "p0")
        orchestrator, timings = PDOrchestrator(d), RequestTimings()
        await orchestrator.reserve(plan, "one", [1, 2, 3], {"max_tokens": 1}, 0, timings)
        items = [i async for i in orchestrator.generate("one", [1, 2, 3], {}, timings, plan)]
        assert [(i["token_ids"], i["finish_reason"]) for i in items] == [([7], "length")]
        worker = d.workers["p0"]
        assert p0.finish_here == [True] and (worker.in_flight, worker.queued_tokens) == (0, 0)
        await d.close()

    asyncio.run(main())


def test_the_model_limits_come_from_a_prefill_worker_while_no_decode_worker_is_live() -> None:
    async def main() -> None:
        d0, p0 = FakeWorker("d0"), FakeWorker("p0")
        d = await start(d0, p0, roles="decode prefill")
        orchestrator = PDOrchestrator(d)
        assert await orchestrator.limits() == {"from": "d0"}
        d.mark_draining("d0")
        assert await orchestrator.limits() == {"from": "p0"}
        await d.close()

    asyncio.run(main())


class InfoWorker(FakeWorker):
    def __init__(self, worker_id: str, max_model_len: int) -> None:
        super().__init__(worker_id)
        self.max_model_len = max_model_len

    async def info(self) -> AsyncIterator[dict[str, Any]]:
        yield {"from": self.worker_id, "max_model_len": self.max_model_len}


@pytest.mark.parametrize("lens", [(2048, 1024), (1024, 2048)])
def test_the_longest_prompt_is_what_both_roles_engines_take(lens: tuple[int, int]) -> None:
    """A prefill worker whose KV pool holds 1,024 tokens, behind decode workers that hold
    2,048: a 1,500-token prompt is refused at the router (400), not failed by the prefill
    worker (503); `/v1/models` says 1,024."""

    async def main() -> None:
        d = await start(InfoWorker("d0", lens[0]), InfoWorker("p0", lens[1]),
                        roles="decode prefill")  # fmt: skip
        assert await PDOrchestrator(d).limits() == {"from": "d0", "max_model_len": 1024}
        await d.close()

    asyncio.run(main())
