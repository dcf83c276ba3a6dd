"""Moving a request's plan to another worker before anything of it runs there: its worker is
draining, lost (its connection closed), or, for decode, has no KV room now while another has.
The plan's load moves with it."""

from __future__ import annotations

import logging

from tandem.router.call_cleanup import close_calls, to_completion, unwritten
from tandem.router.errors import WorkerLost
from tandem.router.route_planner import RoutePlan
from tandem.router.worker_directory import Worker, WorkerDirectory

logger = logging.getLogger(__name__)


async def move_from_draining(directory: WorkerDirectory, plan: RoutePlan, role: str) -> None:
    """The plan's `role` worker is draining: another one takes the request (and its load)."""
    old = _worker(plan, role)
    directory.mark_draining(old.worker_id)
    await move(directory, plan, role, "draining")


async def move(directory: WorkerDirectory, plan: RoutePlan, role: str, why: str) -> None:
    """Another `role` worker takes the request from the plan's (`why`: what became of it).
    With no other prefill worker live, the request starts over (`WorkerLost`), and decode
    prefills it as the planner has new requests do (instead of waiting for a new one)."""
    old = _worker(plan, role)
    if role == "prefill" and not directory.live(role):
        if why == "draining":  # (it started nothing of it: decode frees the grant's blocks)
            plan.grant_handed = False
        message = f"prefill worker {old.worker_id} is {why} and no other is live"
        raise WorkerLost(old.worker_id, message, "prefill_failed", drained=True)
    new = await directory.pick(role)
    logger.info("request moved from %s %s to %s", why, old.worker_id, new.worker_id)
    reassign(plan, role, new)


async def move_granted_from_lost(
    directory: WorkerDirectory, plan: RoutePlan, request_id: str
) -> None:
    """The plan's prefill worker was lost before it was handed decode's grant: another one
    takes the request. With none live the request starts over (`WorkerLost`), and the
    grant, which no worker will write, is released on decode at once (not when its lease
    runs out)."""
    try:
        await move(directory, plan, "prefill", "lost")
    except BaseException:
        await to_completion(close_calls(set(), plan.decode_stream, unwritten(plan, request_id)))
        raise


async def move_for_room(
    directory: WorkerDirectory, plan: RoutePlan, request_id: str, waiting: bool
) -> bool:
    """The plan's decode worker has no KV room now (the reservation is `waiting` there, or
    was refused: a request with a deadline): another one that reported room for the prompt,
    and no reservation waiting, takes the request (not when the plan's worker holds a prefix
    of it). A waiting reservation is withdrawn. Whether it moved."""
    old = plan.decoder
    old.note_reservation(refused=True)
    if plan.decode_hit_blocks:  # (its KV is there: it waits for it)
        return False
    new = roomy_decoder(directory.live("decode"), old, plan.prompt_blocks)
    if new is None:
        return False
    logger.info(
        "request %s: no KV room on %s now; %s has room for it",
        request_id,
        old.worker_id,
        new.worker_id,
    )
    withdrawn = unwritten(plan, request_id) if waiting else None  # (granted meanwhile: freed)
    await to_completion(close_calls(set(), plan.decode_stream, withdrawn))
    reassign(plan, "decode", new)
    return True


def roomy_decoder(workers: list[Worker], busy: Worker, blocks: int) -> Worker | None:
    """The least loaded of `workers` (but `busy`) that last reported `blocks` free KV blocks
    and no reservation waiting for room, and has not refused one since. Its reported free
    blocks are lowered by `blocks` until it reports again (so a burst does not all go there)."""
    for worker in sorted(workers, key=Worker.load):
        stats = worker.stats
        if worker is busy or worker.refusing() or stats.get("num_waiting_reservations", 1):
            continue
        if int(stats.get("num_free_blocks", 0)) >= blocks:
            stats["num_free_blocks"] = int(stats["num_free_blocks"]) - blocks
            return worker
    return None


def reassign(plan: RoutePlan, role: str, new: Worker) -> None:
    """`new` becomes the plan's `role` worker; the request's load moves from the old one."""
    old = _worker(plan, role)
    tokens = plan.decode_tokens if role == "decode" else plan.prefill_tokens
    old.in_flight -= 1
    old.queued_tokens -= tokens
    new.in_flight += 1
    new.queued_tokens += tokens
    if role == "decode" and plan.local_prefill and plan.prefill_pending:  # (its own prefill)
        old.queued_prefill_tokens -= plan.prefill_tokens
        new.queued_prefill_tokens += plan.prefill_tokens
    if role == "decode":
        plan.decode = new
    else:
        plan.prefill = new


def _worker(plan: RoutePlan, role: str) -> Worker:
    worker = plan.decoder if role == "decode" else plan.prefill
    assert worker is not None
    return worker
