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
