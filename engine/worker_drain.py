"""Draining a worker that Serve stops (scale-down, redeploy): no new work, finish what runs.

`WorkTracker` counts the work calls (prefill, generate) a worker is serving and refuses new ones
once draining starts; `drain` waits until the tracker and the worker's own counters (engine
requests, KV transfers) reach zero, or a timeout, and logs what it waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("tandem.worker")

DRAINING = "draining"  # the error code a draining worker refuses new work with
MIN_DRAIN_S = 1.0  # routers refresh their view every 0.5 s: by then none chooses this worker


class WorkTracker:
    """In-flight work calls; `draining` refuses new ones (the caller answers with `refusal`)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False

    def wrap(
        self,
        handler: Callable[..., AsyncIterator[dict[str, Any]]],
        refusal: Callable[[], dict[str, Any]],
    ) -> Callable[..., AsyncIterator[dict[str, Any]]]:
        """`handler`, counted while it runs; once draining, one item: `refusal()`."""

        async def tracked(**args: Any) -> AsyncIterator[dict[str, Any]]:
            if self.draining:
                yield refusal()
                return
            self.in_flight += 1
            try:
                async for item in handler(**args):
                    yield item
            finally:
                self.in_flight -= 1

        return tracked


@dataclass
class DrainReport:
    waited_for: dict[str, int]  # what was in flight when the drain started
    left: dict[str, int]  # what was still in flight when it ended (empty: all finished)
    seconds: float


def _busy(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v > 0}


async def drain(
    name: str,
    counts: Callable[[], Awaitable[dict[str, int]]],
    timeout_s: float,
    poll_s: float = 0.05,
    min_s: float = MIN_DRAIN_S,
) -> DrainReport:
    """Waits until every count in `counts()` is zero, at most `timeout_s`, at least `min_s`
    (work that arrives meanwhile is refused by the `WorkTracker`, which answers it itself)."""
    start = time.monotonic()
    first = _busy(await counts())
    summary = ", ".join(f"{v} {k}" for k, v in first.items()) or "nothing"
    logger.info("%s draining: %s in flight (timeout %.0f s)", name, summary, timeout_s)
    left = first
    while left and time.monotonic() - start < timeout_s:
        await asyncio.sleep(poll_s)
        left = _busy(await counts())
    elapsed = time.monotonic() - start
    if elapsed < min_s:
        await asyncio.sleep(min_s - elapsed)
    if left:
        logger.warning(
            "%s drain timed out after %.1f s; still in flight: %s",
            name,
            elapsed,
            ", ".join(f"{v} {k}" for k, v in left.items()),
        )
    else:
        logger.info("%s drained in %.1f s", name, elapsed)
    return DrainReport(first, left, elapsed)
