"""How the router reads a worker's failure: a 503 (or `WorkerLost`, when the worker's connection
is gone, so the request may start over without it), a 429 when decode has no KV room."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from tandem.engine.rpc import RPCError
from tandem.router.errors import RETRY_AFTER, APIError, WorkerLost, unavailable
from tandem.router.worker_directory import Worker

NO_CAPACITY = "no_capacity"  # what a decode worker without room for a reservation answers
PEER_LOSS_S = 0.5  # how long a transfer failed by its other worker waits to learn it died


async def read_next(stream: AsyncGenerator[dict[str, Any], None], worker: Worker) -> dict[str, Any]:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise unavailable("the decode worker ended the stream early", "decode_failed") from None
    except RPCError as exc:
        raise failed(worker, f"decode worker {worker.worker_id}: {exc}", "decode_failed") from None


async def lost(worker: Worker, news: asyncio.Future[Any] | None) -> bool:
    """Whether `worker`'s connection is gone. Asked when the other worker of a transfer says
    it failed because this one died: its transport may learn it a moment before the router
    does (from its connection, when `news`, the call in flight on it, fails): that moment,
    `PEER_LOSS_S` at most, is waited for."""
    if worker.client.lost_at is None and news is not None and not news.done():
        await asyncio.wait({news}, timeout=PEER_LOSS_S)
    return worker.client.lost_at is not None


def failed(worker: Worker, message: str, code: str) -> APIError:
    """A 503 for a call to `worker` that failed; `WorkerLost` when its connection is gone."""
    if worker.client.lost_at is not None:
        return WorkerLost(worker.worker_id, message, code, drained=worker.draining)
    return unavailable(message, code)


MAX_LOST_RETRIES = 1
"""Times a request goes on after losing a worker it uses (the workers' deaths are seen at once:
the router holds a connection to each). Lost before it sent its caller anything, it starts
over; lost mid-stream (its decode worker died), it continues where the stream stopped when the
continuation is the same as the lost one would have been: any request but a structured output
(see `Prepared.resumable`)."""

MAX_DRAINED_MOVES = 4
"""Besides those, times a request goes on after a worker that was draining (Serve stopping it)
left with it when its `drain_timeout_s` ran out: a rolling update may drain the worker it moved
to as well, and such a move is no sign of a failing request."""


class LossAllowance:
    """How many lost workers one request survives: `max_lost` deaths, and besides those
    `max_drained` workers that left it when their drain ran out (a scale-down, or a rolling
    update, which may drain the worker it moved to next)."""

    def __init__(
        self, max_lost: int = MAX_LOST_RETRIES, max_drained: int = MAX_DRAINED_MOVES
    ) -> None:
        self.lost_left = max_lost
        self.drained_left = max_drained

    def spend(self, exc: WorkerLost) -> bool:
        """Whether the request may go on after `exc` (and one allowance less)."""
        if exc.drained and self.drained_left > 0:
            self.drained_left -= 1
            return True
        if self.lost_left > 0:
            self.lost_left -= 1
            return True
        return False


def worker_error(item: dict[str, Any]) -> APIError:
    code = str(item.get("code", "worker_error"))
    if code == NO_CAPACITY:
        return APIError(
            429,
            f"no KV cache room on the decode worker now: {item['error']}",
            type="rate_limit_error",
            code="decode_full",
            headers=RETRY_AFTER,
        )
    if code == "internal_error":  # a step failed on the worker; it serves on
        return APIError(500, str(item.get("error")), type="server_error", code=code)
    return unavailable(str(item.get("error", "worker error")), code)
