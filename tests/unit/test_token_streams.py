"""A step's token items reach their streams' queues in one hand-over per event loop, in order."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from tandem.decode_workers.token_streams import StreamOutbox


def test_a_flush_hands_each_loop_its_items_in_one_call_and_in_order() -> None:
    async def run() -> tuple[list[list[Any]], int]:
        loop = asyncio.get_running_loop()
        calls = 0
        handover = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any) -> Any:
            nonlocal calls
            calls += callback.__module__ == StreamOutbox.__module__  # (not to_thread's own)
            return handover(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in range(3)]
        outbox = StreamOutbox()

        def engine_thread() -> None:  # (two steps, as the decode service's thread makes them)
            for step in range(2):
                for i, queue in enumerate(queues):
                    outbox.add(loop, queue, (step, i))
                outbox.flush()
            outbox.flush()  # (nothing pending: no call)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        await asyncio.to_thread(thread.join)
        got = [[await q.get(), await q.get()] for q in queues]
        assert all(q.empty() for q in queues)
        return got, calls

    got, calls = asyncio.run(run())
    assert got == [[(0, i), (1, i)] for i in range(3)]
    assert calls == 2


def _stream() -> Any:
    from tandem.decode_workers.token_streams import TokenStream
    from tandem.engine.sampling_params import SamplingParams

    return TokenStream(
        asyncio.new_event_loop(), asyncio.Queue(), [1, 2], SamplingParams(max_tokens=8)
    )


def _item(token: int, **extra: Any) -> dict[str, Any]:
    return {"type": "tokens", "token_ids": [token], "text": f"<{token}>", **extra}


def test_a_stream_interval_holds_tokens_until_it_has_that_many() -> None:
    stream = _stream()
    try:
        out = [stream.gathered(_item(t, logprobs=[-t]), 3) for t in range(1, 8)]
        assert out[0] is None and out[1] is None and out[3] is None and out[4] is None
        assert out[2] is not None and out[5] is not None and out[6] is None
        assert out[2]["token_ids"] == [1, 2, 3] and out[2]["text"] == "<1><2><3>"
        assert out[2]["logprobs"] == [-1, -2, -3]
        assert out[5]["token_ids"] == [4, 5, 6]
        # The item that ends the stream goes at once, with what was held before it.
        last = stream.gathered(_item(8, finish_reason="length", stop_reason=None), 3)
        assert last is not None and last["token_ids"] == [7, 8]
        assert last["text"] == "<7><8>" and last["finish_reason"] == "length"
        assert stream.held is None
    finally:
        stream.loop.close()


def test_a_stream_interval_of_one_holds_nothing() -> None:
    stream = _stream()
    try:
        assert stream.gathered(_item(5), 1) == _item(5)
        assert stream.held is None
    finally:
        stream.loop.close()
