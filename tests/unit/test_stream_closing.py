"""A client that leaves mid-stream closes every generator of its request at once, not when the
garbage collector gets to them: closing is what cancels the request on its workers.

The inner generators are kept referenced on purpose, so only an explicit close can run their
`finally`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from tandem.engine.sampling_params import SamplingParams
from tandem.router.openai_stream import ClosingStreamingResponse
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.prefill_call import PrefillCall
from tandem.router.prepared import Prepared
from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving


class Tracked:
    """Async generators that record when they were closed; references kept in `gens`."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.gens: list[Any] = []

    def items(self, name: str, sse: bool = False) -> AsyncIterator[Any]:
        gen = self._items(name, sse)
        self.gens.append(gen)
        return gen

    async def _items(self, name: str, sse: bool) -> AsyncIterator[Any]:
        try:
            for i in range(100):
                yield f"data: {i}\n\n" if sse else {"token_ids": [i], "text": f"t{i}"}
        finally:
            self.closed.append(name)


class FakeOrchestrator(Tracked):
    def generate(self, *args: Any) -> AsyncIterator[Any]:
        return self.items("orchestrator")


def prepared() -> Prepared:
    decode = SimpleNamespace(worker_id="decode/x")
    plan = SimpleNamespace(prefill=None, decode=decode, decoder=decode, decode_hit_blocks=0)
    return Prepared(
        "cmpl-1", [1, 2, 3], SamplingParams(max_tokens=100), RequestTimings(), plan=plan
    )  # type: ignore[arg-type]


def test_closing_serving_run_closes_the_orchestrator_stream() -> None:
    orchestrator = FakeOrchestrator()
    serving = Serving(orchestrator, None, None, "tiny")  # type: ignore[arg-type]

    async def main() -> None:
        run = serving.run(prepared())
        assert (await run.__anext__())["token_ids"] == [0]
        assert (await run.__anext__())["token_ids"] == [1]
        assert orchestrator.closed == []
        await run.aclose()
        assert orchestrator.closed == ["orchestrator"]  # now, not at the loop's shutdown

    asyncio.run(main())


def test_streaming_response_closes_its_body_when_the_send_is_cancelled() -> None:
    body = Tracked()
    sent: list[dict[str, Any]] = []
    blocked = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("type") == "http.response.body" and len(sent) >= 3:
            blocked.set()
            await asyncio.sleep(3600)  # the client stopped reading

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def main() -> None:
        response = ClosingStreamingResponse(
            body.items("sse", sse=True), media_type="text/event-stream"
        )
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        task = asyncio.create_task(response(scope, receive, send))
        await asyncio.wait_for(blocked.wait(), 10)
        assert body.closed == []
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert body.closed == ["sse"]  # now, not at the loop's shutdown

    asyncio.run(main())
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 2


def test_a_client_leaving_behind_serves_proxy_ends_the_stream_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Behind Serve's proxy a client that leaves makes `receive` raise `TaskCancelledError`:
    the stream ends and its body is closed, with one INFO line, not an error and traceback."""
    body = Tracked()
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) >= 2:
            gone.set()
            await asyncio.sleep(3600)

    async def receive() -> dict[str, Any]:
        await gone.wait()
        raise TaskCancelledError()

    async def main() -> None:
        response = ClosingStreamingResponse(
            body.items("sse", sse=True), media_type="text/event-stream"
        )
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}  # as Serve's replicas run it
        await asyncio.wait_for(response(scope, receive, send), 10)  # returns, no exception

    with caplog.at_level(logging.INFO, logger="tandem.router.openai_stream"):
        asyncio.run(main())
    assert body.closed == ["sse"]
    assert [r.getMessage() for r in caplog.records] == ["client left during the stream"]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in caplog.records)


def test_a_request_cancelled_by_its_http_server_closes_its_decode_call() -> None:
    """Starlette runs a request in an anyio cancel scope: once cancelled, every later await of
    the request raises again. The decode call must still be closed (its cancel sent to the
    worker) and the plan's load released."""
    decode = Tracked()
    arrived = asyncio.Event()

    async def decode_stream() -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"type": "tokens", "token_ids": [0], "text": "a"}
            await arrived.wait()
            yield {"type": "tokens", "token_ids": [1], "text": "b"}
            await asyncio.sleep(3600)
        finally:
            decode.closed.append("decode")

    class Plan:
        prefill = None
        grant = None
        prefill_call = None
        prefill_only = False

        def __init__(self) -> None:
            self.decode_stream = decode_stream()
            self.decode = self.decoder = SimpleNamespace(worker_id="decode/x")
            self.released = False

        def release_prefill(self) -> None:
            pass

        def release(self) -> None:
            self.released = True

    plan = Plan()
    orchestrator = PDOrchestrator(None)  # type: ignore[arg-type]

    async def main() -> None:
        items = orchestrator.generate("r", [1, 2], {}, RequestTimings(), plan)  # type: ignore[arg-type]
        with anyio.CancelScope() as scope:
            async with contextlib.aclosing(items):
                async for item in items:
                    if item["token_ids"] == [0]:
                        # the next item arrives in the same loop turn as the cancellation
                        asyncio.get_running_loop().call_soon(arrived.set)
                        asyncio.get_running_loop().call_soon(scope.cancel)
        assert scope.cancelled_caught
        for _ in range(10):
            await asyncio.sleep(0)
        assert decode.closed == ["decode"]  # now, not at the loop's shutdown
        assert plan.released

    asyncio.run(main())


def test_a_client_gone_before_the_first_byte_closes_the_reserved_calls() -> None:
    """`prepare` reserved on decode and started the prefill call; the client leaves before the
    stream's body starts, so `run` never runs: `Serving.abandon` (the response's `on_close`)
    closes both calls and releases the plan's load now."""
    closed: list[str] = []

    async def decode_stream() -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"type": "grant"}
            await asyncio.sleep(3600)
            yield {}
        finally:
            closed.append("decode")

    async def prefill_call() -> dict[str, Any]:
        try:
            await asyncio.sleep(3600)
        finally:
            closed.append("prefill")
        return {}

    class Plan:
        prefill = SimpleNamespace(worker_id="prefill/x", client=SimpleNamespace(lost_at=None))
        decode = decoder = SimpleNamespace(worker_id="decode/x")
        prefill_hit_blocks = decode_hit_blocks = 0
        # (handed to a prefill worker that lives: no release on decode to ask for)
        grant, grant_handed = {"dst_block_ids": [1]}, True

        def __init__(self) -> None:
            self.decode_stream = decode_stream()
            self.released = False

        def release(self) -> None:
            self.released = True

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}  # gone already

    async def send(message: dict[str, Any]) -> None:
        raise OSError("client gone")

    async def main() -> tuple[Plan, Prepared]:
        plan = Plan()
        await anext(plan.decode_stream)  # the reservation `prepare` waited for
        task = asyncio.ensure_future(prefill_call())
        early: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        plan.prefill_call = PrefillCall(task, early)  # type: ignore[attr-defined]
        await asyncio.sleep(0)
        serving = Serving(PDOrchestrator(None), None, None, "tiny")  # type: ignore[arg-type]
        req = Prepared("cmpl-2", [1, 2], SamplingParams(max_tokens=4), RequestTimings(), plan=plan)  # type: ignore[arg-type]
        body = Tracked()
        response = ClosingStreamingResponse(
            body.items("sse", sse=True),
            media_type="text/event-stream",
            on_close=lambda: serving.abandon(req),
        )
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        with contextlib.suppress(ClientDisconnect):
            await response(scope, receive, send)
        return plan, req

    plan, req = asyncio.run(main())
    assert sorted(closed) == ["decode", "prefill"]
    assert plan.released and req.started
