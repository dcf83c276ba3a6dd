"""A stopping router ends the requests it still runs just before Serve kills it: with a 503
that says why (`router_stopping`), not a cut connection; a request's own deadline is a 504."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.router.errors import APIError
from tandem.router.prepared import Prepared
from tandem.router.replica_watch import STOP_MARGIN_S, ReplicaWatch
from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving
from tandem.router.stream_deadlines import StreamDeadlines
from tests.unit.test_worker_lost import FakePlanner, FakeTokenizer


class SlowOrchestrator:
    """Streams one token every `every_s`, forever (until the request's end)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s

    async def generate(self, *args: Any) -> AsyncIterator[dict[str, Any]]:
        token = 100
        while True:
            await asyncio.sleep(self.every_s)
            yield {"token_ids": [token], "text": f"<{token}>", "finish_reason": None}
            token += 1


async def _stream(serving: Serving, tokens: list[int]) -> None:
    planner = FakePlanner()
    req = Prepared("cmpl-1", [1, 2], SamplingParams(max_tokens=10_000), RequestTimings(),
                   plan=await planner.plan())  # type: ignore[arg-type]  # fmt: skip
    async for item in serving.run(req):
        tokens.extend(item["token_ids"])


def _serving(timeout_s: float) -> Serving:
    return Serving(SlowOrchestrator(0.01), FakePlanner(), FakeTokenizer(), "tiny",  # type: ignore[arg-type]
                   request_timeout_s=timeout_s)  # fmt: skip


def test_a_stopping_routers_requests_end_with_a_503_that_says_why() -> None:
    serving = _serving(timeout_s=600)
    tokens: list[int] = []

    async def run() -> None:
        streams = [asyncio.create_task(_stream(serving, tokens)) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert serving.deadlines.running_count == 2
        serving.deadlines.cut_at(asyncio.get_running_loop().time() + 0.1, "router going away")
        for stream in streams:
            with pytest.raises(APIError) as ended:
                await stream
            assert (ended.value.status, ended.value.code) == (503, "router_stopping")
            assert ended.value.message == "router going away"
        # a request that starts after the cut ends by it too
        with pytest.raises(APIError) as late:
            await _stream(serving, [])
        assert late.value.code == "router_stopping"
        assert serving.deadlines.running_count == 0

    asyncio.run(run())
    assert tokens  # (both streamed until the cut)


def test_a_requests_own_deadline_is_a_504() -> None:
    serving = _serving(timeout_s=0.1)

    async def run() -> APIError:
        with pytest.raises(APIError) as ended:
            await _stream(serving, [])
        return ended.value

    error = asyncio.run(run())
    assert (error.status, error.type) == (504, "timeout")


def test_the_watch_cuts_once_just_before_serves_grace_runs_out() -> None:
    deadlines = StreamDeadlines(600)
    watch = ReplicaWatch("tandem", "r", ("prefill", "decode"), {"decode": 2}, deadlines, 30.0)
    assert watch.targets == {"router": 1, "decode": 2}

    async def run() -> tuple[float | None, float]:
        async with deadlines.running() as deadline:
            now = asyncio.get_running_loop().time()
            watch.stopping(seen_within_s=2.0)
            first = deadline.when()
            watch.stopping(seen_within_s=2.0)  # (seen again: nothing changes)
            assert deadline.when() == first
            return first, now

    when, now = asyncio.run(run())
    assert when is not None and abs((when - now) - (30.0 - 2.0 - STOP_MARGIN_S)) < 0.5
    idle = ReplicaWatch("tandem", "r", ("decode",), {}, StreamDeadlines(600), grace_s=0.0)
    idle.stopping(2.0)
    assert not idle.stop_seen  # (no grace known: nothing is cut)
