"""Behind HAProxy (`Serving.sse_keepalive_s` set) a stream that waits writes SSE comments, so that
HAProxy, which notices a client's leaving only on a write, notices it during a long prefill too;
closing the stream cancels the request while it waits. Without it (Serve's proxy) no comment is
written: clients that parse every SSE line as JSON would fail on one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.router import openai_stream
from tandem.router.errors import APIError
from tandem.router.prepared import Prepared
from tandem.router.request_timings import RequestTimings


class FakeServing:
    """`run` waits `wait_s` before its first item (a prefill), then streams two tokens."""

    model_name = "tiny"

    def __init__(self, wait_s: float, fail: bool = False, keepalive_s: float | None = 0.05) -> None:
        self.sse_keepalive_s = keepalive_s
        self.wait_s = wait_s
        self.fail = fail
        self.ended: list[str] = []

    async def run(self, req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        try:
            await asyncio.sleep(self.wait_s)
            if self.fail:
                raise APIError(503, "decode worker decode/x: gone", code="decode_failed")
            yield {"token_ids": [5], "text": "a"}
            yield {"token_ids": [6], "text": "b", "finish_reason": "length"}
            self.ended.append("finished")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise


def _prepared() -> Prepared:
    plan = SimpleNamespace(prefill=None, decode=SimpleNamespace(worker_id="decode/x"))
    return Prepared("cmpl-1", [1, 2], SamplingParams(max_tokens=2), RequestTimings(), plan=plan)  # type: ignore[arg-type]


async def _events(serving: FakeServing) -> list[str]:
    gen = openai_stream.sse(serving, _prepared(), "completion", False)  # type: ignore[arg-type]
    return [event async for event in gen]


def test_a_waiting_stream_writes_comments_then_its_tokens() -> None:
    serving = FakeServing(wait_s=0.3)
    events = asyncio.run(_events(serving))
    comments = [e for e in events if e.startswith(":")]
    data = [e for e in events if not e.startswith(":")]
    assert 3 <= len(comments) <= 7 and set(comments) == {": keep-alive\n\n"}
    assert events.index(data[0]) == len(comments)  # all before the first token
    assert ['"text":"a"' in data[0], '"text":"b"' in data[1], data[2]] == [
        True,
        True,
        "data: [DONE]\n\n",
    ]
    assert serving.ended == ["finished"]


def test_without_haproxy_a_waiting_stream_writes_no_comment() -> None:
    serving = FakeServing(wait_s=0.3, keepalive_s=None)
    events = asyncio.run(_events(serving))
    assert len(events) == 3 and not [e for e in events if e.startswith(":")]
    assert serving.ended == ["finished"]


def test_a_stream_that_does_not_wait_writes_no_comment() -> None:
    events = asyncio.run(_events(FakeServing(wait_s=0.0)))
    assert not [e for e in events if e.startswith(":")] and len(events) == 3


def test_closing_a_waiting_stream_cancels_its_request() -> None:
    serving = FakeServing(wait_s=3600)

    async def main() -> None:
        gen = openai_stream.sse(serving, _prepared(), "completion", False)  # type: ignore[arg-type]
        assert await gen.__anext__() == ": keep-alive\n\n"
        await gen.aclose()  # the client left during prefill
        await asyncio.sleep(0)

    asyncio.run(main())
    assert serving.ended == ["cancelled"]


def test_an_error_while_waiting_is_an_error_event() -> None:
    events = asyncio.run(_events(FakeServing(wait_s=0.12, fail=True)))
    data = [e for e in events if not e.startswith(":")]
    assert '"code":"decode_failed"' in data[0] and data[1] == "data: [DONE]\n\n"
