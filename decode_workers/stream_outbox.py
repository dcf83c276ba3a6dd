"""Items for the token streams' asyncio queues, made on the engine's thread and handed to their
event loop in one call a step.

`loop.call_soon_threadsafe` writes to the loop's self-pipe each time: a step's tokens for 32
streams were 32 writes (syscalls) on the engine's thread and as many wake-ups of the loop,
which then contends with the engine for the process's GIL.
"""

from __future__ import annotations

import asyncio
from typing import Any

_Pairs = list[tuple[asyncio.Queue[Any], Any]]


class StreamOutbox:
    """Collects (queue, item) pairs per event loop (`add`), then hands each loop its pairs in
    one call, in the order they were added (`flush`)."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, _Pairs] = {}

    def add(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], item: Any) -> None:
        self._pending.setdefault(loop, []).append((queue, item))

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, pairs in pending.items():
            loop.call_soon_threadsafe(_put_all, pairs)


def _put_all(pairs: _Pairs) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)
