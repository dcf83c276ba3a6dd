"""Ending a request's calls on its workers, whatever ends it (finished, failed, client gone).

`close_calls` cancels the calls in flight and closes the decode stream; with the decode worker
named (`unwritten_release`: decode reserved but no prefill worker was handed the grant) it also
has that worker release the reserved blocks at once, which it would otherwise hold for its stall
timeout in case pages still came. `to_completion` runs such a clean-up to its end even when the
request's own task is being cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

from tandem.engine.rpc import RPCError
from tandem.router.route_planner import RoutePlan
from tandem.router.worker_directory import Worker

logger = logging.getLogger("tandem.router")

UNWRITTEN_RELEASE_S = 5.0
"""How long the router waits for a decode worker to release a reservation no prefill worker
was handed (it only logs a failure: the worker's stall timeout frees the blocks anyway)."""


_cleanups: set[asyncio.Future[None]] = set()  # strong references while they run


async def to_completion(cleanup: Awaitable[None]) -> None:
    """Runs `cleanup` to its end in its own task. When the HTTP server cancels a request
    (anyio cancel scopes), every later await of that request is cancelled too, so a clean-up
    awaited inline could stop half-way and leave the call running on its worker."""
    task = asyncio.ensure_future(cleanup)
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    await asyncio.shield(task)


async def close_calls(
    pending: set[asyncio.Future[Any]],
    stream: AsyncGenerator[dict[str, Any], None] | None,
    unwritten: tuple[Worker, str] | None = None,
) -> None:
    """Cancels the request's calls in flight and closes its decode stream (if opened);
    closing a call cancels it on its worker. With `unwritten` (decode worker, request id), no
    prefill worker was handed the request's grant: that worker releases the reserved blocks
    at once (else it holds them for its stall timeout, as pages might still come)."""
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if stream is None:
        return
    await stream.aclose()
    if unwritten is not None:
        worker, request_id = unwritten
        try:
            async with asyncio.timeout(UNWRITTEN_RELEASE_S):
                await worker.client.call("release_unwritten", request_id=request_id)
        except (RPCError, TimeoutError) as exc:  # (its stall timeout frees them anyway)
            logger.info(
                "%s: release of %s's blocks not taken: %s", worker.worker_id, request_id, exc
            )


def unwritten_release(plan: RoutePlan, request_id: str) -> tuple[Worker, str] | None:
    """(decode worker, request id) when decode reserved for the request but no prefill worker
    was handed the grant."""
    return None if plan.grant is None or plan.grant_handed else (plan.decoder, request_id)
