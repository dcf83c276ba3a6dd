"""A client that leaves before its request is routed (during tokenization, routing or decode's
reservation) is logged and counted as an abort, like one that leaves later; one that leaves
after routing but before the first byte too."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving


class HangingOrchestrator:
    def __init__(self, hang: bool = True) -> None:
        self.hang = hang
        self.reserving = asyncio.Event()
        self.abandoned = 0

    async def limits(self) -> dict[str, Any]:
        return {"max_model_len": 64, "vocab_size": 100, "block_size": 4}

    async def reserve(self, *args: Any) -> None:
        self.reserving.set()
        if self.hang:
            await asyncio.Event().wait()  # (decode never answers)

    async def abandon(self, plan: Any, request_id: str) -> None:
        self.abandoned += 1


class Planner:
    policy_name = "least_loaded"
    admission = SimpleNamespace(
        priority=lambda priority, user: priority or 0, deadline_ms=lambda ms, user: ms
    )

    def __init__(self) -> None:
        self.released = 0

    async def plan(self, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(
            prefill=None,
            decode=SimpleNamespace(worker_id="decode/a"),
            decode_hit_blocks=0,
            grant=None,
            release=self._release,
        )

    def _release(self) -> None:
        self.released += 1


def _aborts(serving: Serving) -> float:
    registry = serving.metrics.registry
    value = registry.get_sample_value(
        "tandem:request_success_total",
        {**serving.metrics.labels, "finished_reason": "abort"},
    )
    return value or 0.0


def test_a_client_leaving_during_the_reservation_is_an_abort(caplog: Any) -> None:
    orchestrator, planner = HangingOrchestrator(), Planner()
    serving = Serving(orchestrator, planner, tokenizer=None, model_name="tiny")  # type: ignore[arg-type]

    async def scenario() -> None:
        task = asyncio.ensure_future(
            serving.prepare("cmpl-9", None, [1, 2, 3], 4, {}, RequestTimings())
        )
        await orchestrator.reserving.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="tandem.router"):
        asyncio.run(scenario())
    assert planner.released == 1  # (the plan's hold on the workers is given back)
    assert _aborts(serving) == 1
    assert "request cmpl-9 cancelled(client left before it was routed)" in caplog.text


def test_a_client_leaving_before_the_first_byte_is_an_abort(caplog: Any) -> None:
    orchestrator = HangingOrchestrator(hang=False)
    serving = Serving(orchestrator, Planner(), tokenizer=None, model_name="tiny")  # type: ignore[arg-type]

    async def scenario() -> None:
        req = await serving.prepare("cmpl-8", None, [1, 2, 3], 4, {}, RequestTimings())
        await serving.abandon(req)
        await serving.abandon(req)  # (once)

    with caplog.at_level(logging.INFO, logger="tandem.router"):
        asyncio.run(scenario())
    assert orchestrator.abandoned == 1 and _aborts(serving) == 1
    assert "request cmpl-8 cancelled(client left before the first byte)" in caplog.text
