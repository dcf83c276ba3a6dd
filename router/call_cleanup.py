"""Ending a request's calls on its workers, whatever ends it (finished, failed, client gone).

`close_calls` cancels the calls in flight and closes the decode stream. Decode holds the blocks
of a reservation that ends before its pages all came for its stall timeout, in case pages still
come; with a `BlockRelease` (`held_blocks_release`) the router tells it sooner who could write
them: no prefill worker (the grant was never handed: they go back at once), or a prefill worker
the router lost (they go back once decode's transport confirms that worker's process is gone).
`to_completion` runs such a clean-up to its end even when the request's own task is being
cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import Any

from tandem.engine.rpc import RPCError
from tandem.router.route_planner import RoutePlan
from tandem.router.worker_directory import Worker

logger = logging.getLogger("tandem.router")

RELEASE_S = 5.0
"""How long the router waits for a decode worker to take a `BlockRelease` (it only logs a
failure: the worker's stall timeout frees the blocks anyway)."""


_cleanups: set[asyncio.Future[None]] = set()  # strong references while they run


async def to_completion(cleanup: Awaitable[None]) -> None:
    """Runs `cleanup` to its end in its own task. When the HTTP server cancels a request
    (anyio cancel scopes), every later await of that request is cancelled too, so a clean-up
    awaited inline could stop half-way and leave the call running on its worker."""
    task = asyncio.ensure_future(cleanup)
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    await asyncio.shield(task)


@dataclass(frozen=True)
class BlockRelease:
    """A decode worker's RPC method that releases a request's held blocks, and its arguments."""

    worker: Worker
    method: str  # "release_unwritten" or "release_from_lost_sender"
    args: dict[str, str]


async def close_calls(
    pending: set[asyncio.Future[Any]],
    stream: AsyncGenerator[dict[str, Any], None] | None,
    release: BlockRelease | None = None,
) -> None:
    """Cancels the request's calls in flight and closes its decode stream (if opened); closing
    a call cancels it on its worker. Then `release`, if any (see the module docstring)."""
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if stream is None:
        return
    await stream.aclose()
    if release is not None:
        try:
            async with asyncio.timeout(RELEASE_S):
                await release.worker.client.call(release.method, **release.args)
        except (RPCError, TimeoutError) as exc:  # (its stall timeout frees them anyway)
            logger.info(
                "%s: %s of %s's blocks not taken: %s",
                release.worker.worker_id,
                release.method,
                release.args["request_id"],
                exc,
            )


def unwritten(plan: RoutePlan, request_id: str) -> BlockRelease:
    """Decode reserved, and no prefill worker was handed the grant: release at once."""
    return BlockRelease(plan.decoder, "release_unwritten", {"request_id": request_id})


def held_blocks_release(plan: RoutePlan, request_id: str) -> BlockRelease | None:
    """What to tell decode of a request that ends with a reservation there: no prefill worker
    was handed its grant (`unwritten`), or the one that was is lost; else nothing."""
    if plan.grant is None:
        return None
    if not plan.grant_handed:
        return unwritten(plan, request_id)
    sender = plan.prefill
    if sender is not None and sender.client.lost_at is not None and sender.kv_address:
        args = {"request_id": request_id, "sender": sender.kv_address}
        return BlockRelease(plan.decoder, "release_from_lost_sender", args)
    return None
