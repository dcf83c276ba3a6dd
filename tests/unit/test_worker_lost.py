"""A worker lost before the request sent its caller anything: the request starts over once,
under a new worker-side id, on a new plan; after the first token, or a second time, it fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.router.errors import WorkerLost
from tandem.router.pd_orchestrator import RequestTimings
from tandem.router.serving import Prepared, Serving


class FakePlan(SimpleNamespace):
    released: bool = False

    def release(self) -> None:
        self.released = True


class FakePlanner:
    policy_name = "least_loaded"

    def __init__(self) -> None:
        self.plans: list[FakePlan] = []

    async def plan(self, *args: Any, **kwargs: Any) -> FakePlan:
        plan = FakePlan(prefill=None, decode=SimpleNamespace(worker_id="decode/b"),
                        decode_hit_blocks=0)  # fmt: skip
        self.plans.append(plan)
        return plan


class FakeOrchestrator:
    """`generate` loses its worker on the calls listed in `lose` (by call number), before or
    after its first item."""

    def __init__(self, lose: dict[int, str]) -> None:
        self.lose = lose
        self.generated: list[str] = []
        self.reserved: list[str] = []

    async def reserve(self, plan: Any, request_id: str, *args: Any) -> None:
        self.reserved.append(request_id)

    async def generate(self, request_id: str, *args: Any) -> AsyncIterator[dict[str, Any]]:
        call = len(self.generated)
        self.generated.append(request_id)
        when = self.lose.get(call)
        if when == "before":
            raise WorkerLost("prefill/a", "connection to prefill/a lost", "prefill_failed")
        yield {"token_ids": [7], "text": "x"}
        if when == "after":
            raise WorkerLost("decode/b", "connection to decode/b lost", "decode_failed")
        yield {"token_ids": [8], "text": "y", "finish_reason": "length"}


def _serving(orchestrator: FakeOrchestrator) -> tuple[Serving, FakePlanner]:
    planner = FakePlanner()
    return Serving(orchestrator, planner, None, "tiny"), planner  # type: ignore[arg-type]


def _prepared(planner: FakePlanner) -> Prepared:
    plan = asyncio.run(planner.plan())
    return Prepared(
        "cmpl-1",
        [1, 2, 3],
        SamplingParams(max_tokens=2),
        RequestTimings(),
        plan=plan,  # type: ignore[arg-type]
    )


async def _collect(serving: Serving, req: Prepared) -> list[list[int]]:
    return [item["token_ids"] async for item in serving.run(req)]


def test_a_worker_lost_before_the_first_token_starts_the_request_over() -> None:
    orchestrator = FakeOrchestrator({0: "before"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner)
    assert asyncio.run(_collect(serving, req)) == [[7], [8]]
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1"]  # a new id for the workers
    assert orchestrator.reserved == ["cmpl-1~1"]  # a fresh reservation on a new plan
    assert len(planner.plans) == 2 and planner.plans[1] is req.plan
    assert (req.completion_tokens, req.finish_reason, req.attempt) == (2, "length", 1)


def test_a_worker_lost_after_the_first_token_fails_the_request() -> None:
    orchestrator = FakeOrchestrator({0: "after"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner)
    with pytest.raises(WorkerLost):
        asyncio.run(_collect(serving, req))
    assert orchestrator.generated == ["cmpl-1"] and req.completion_tokens == 1


def test_a_request_starts_over_once_at_most() -> None:
    orchestrator = FakeOrchestrator({0: "before", 1: "before"})
    serving, planner = _serving(orchestrator)
    with pytest.raises(WorkerLost):
        asyncio.run(_collect(serving, _prepared(planner)))
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1"]
