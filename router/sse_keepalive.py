"""SSE comments for a stream that waits, behind Ray's HAProxy ingress.

HAProxy notices a client that left only when the response next writes. A stream that waits (a
long prefill, a queue) therefore writes an SSE comment (`: keep-alive`) every `KEEPALIVE_S`;
without them, a client leaving during prefill was seen at the first token, the prefill running
to its end. Behind Serve's proxy, which passes a disconnect on at once, none is written: clients
that parse every line as JSON (as `vllm bench serve`'s does) would fail on one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TypeVar

KEEPALIVE_S = 0.25
"""Behind HAProxy, a waiting stream writes an SSE comment this often (seconds)."""
KEEPALIVE = ": keep-alive\n\n"

T = TypeVar("T")


async def paced(items: AsyncGenerator[T, None], every_s: float) -> AsyncGenerator[T | None, None]:
    """`items`, and None whenever `every_s` pass without one. One task drives `items` from
    start to end (its timeouts stay bound to it); closing this cancels that task."""
    queue: asyncio.Queue[tuple[T | None, BaseException | None, bool]] = asyncio.Queue()

    async def drive() -> None:
        try:
            async with contextlib.aclosing(items):
                async for item in items:
                    queue.put_nowait((item, None, False))
        except Exception as exc:  # (APIError, ...) raised where the caller reads
            queue.put_nowait((None, exc, True))
            return
        queue.put_nowait((None, None, True))

    driver = asyncio.create_task(drive())
    try:
        while True:
            try:
                async with asyncio.timeout(every_s):
                    item, error, ended = await queue.get()
            except TimeoutError:
                yield None
                continue
            if error is not None:
                raise error
            if ended:
                return
            yield item
    finally:
        driver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await driver
