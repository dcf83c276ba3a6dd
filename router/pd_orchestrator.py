"""One request through the PD cluster: reserve on decode, prefill elsewhere, stream tokens back.

1. A streaming call to a decode replica reserves blocks and yields the reservation grant; the
   same call then yields the request's tokens, so reservation and decode share one replica.
   The prefill call starts at the same time: prefill computes while decode reserves (unless
   that decode replica has just refused a reservation for want of room: then after the grant).
2. The grant goes to the prefill replica, which streams pages straight to decode.
   It sends the first token back as soon as it is sampled: that is the caller's first token.
3. Further tokens flow from decode to the caller. If prefill fails first, the decode stream is closed.
Leaving early (client gone, error, timeout) cancels both calls; the workers release their
blocks and tell each other through the transfer protocol. The router only awaits: it never
blocks its event loop. Calls go over the workers' RPC endpoints (`tandem.engine.rpc`), not
through Serve handles, and each role's least-loaded worker is picked (`WorkerDirectory`).

A worker that Serve is stopping refuses new work with code "draining" before it started any:
the request moves to another worker of the role (the plan's held load moves with it), at most
`MAX_DRAIN_RETRIES` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

from tandem.engine.rpc import RPCError
from tandem.kv_transfer.events import SENDER_GONE
from tandem.router.call_cleanup import close_calls, held_blocks_release, to_completion, unwritten
from tandem.router.errors import APIError, unavailable
from tandem.router.plan_moves import move_for_room, move_from_draining, move_granted_from_lost
from tandem.router.prefill_call import (
    PrefillCall,
    start_prefill_call,
    without_streamed,
)
from tandem.router.request_timings import RequestTimings
from tandem.router.route_planner import RoutePlan
from tandem.router.worker_directory import Worker, WorkerDirectory
from tandem.router.worker_failures import (
    NO_CAPACITY,
    failed,
    lost,
    read_next,
    worker_error,
)

logger = logging.getLogger("tandem.router")

DRAINING = "draining"  # what a worker that is shutting down answers new work with
MAX_DRAIN_RETRIES = 3


class PDOrchestrator:
    def __init__(self, directory: WorkerDirectory) -> None:
        self.directory = directory

    async def limits(self) -> dict[str, Any]:
        """The model's limits and cache key, from a decode worker (or a prefill worker while
        none is live: a one-token request needs no decode worker). A prompt must fit both
        roles' engines: `max_model_len` is the shorter of a decode and a prefill worker's (a
        role's KV pool may cap it below the model's context)."""
        directory = self.directory
        role = "prefill" if directory.live("prefill") and not directory.live("decode") else "decode"
        info = await _info(await directory.pick(role))
        if role == "decode" and directory.live("prefill"):
            other = await _info(await directory.pick("prefill"))
            if "max_model_len" in info and "max_model_len" in other:
                info["max_model_len"] = min(info["max_model_len"], other["max_model_len"])
        return info

    async def reserve(
        self,
        plan: RoutePlan,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        priority: int,
        timings: RequestTimings,
    ) -> None:
        """Opens the request's decode stream; with a prefill worker, waits for the decode
        worker's reservation (with no KV room there now, the request waits its turn for it,
        `reserve_wait_s` at most: then 429). Kept on the plan.
        A one-token request (`plan.prefill_only`) only starts its call on the prefill worker."""
        if plan.prefill_only:
            assert plan.prefill is not None
            plan.prefill_call = start_prefill_call(
                plan.prefill, request_id, prompt_token_ids, params, None, priority, True
            )
            timings.mark("reserved")
            return
        if plan.prefill is None:
            _open_decode(plan, request_id, prompt_token_ids, params, priority)
            return
        # Prefill computes while decode reserves; its pages wait for the grant. Its call goes
        # out first (one loop turn before decode's): it is the longer way to the first token.
        # Not while the decode worker is refusing for want of room: a refusal would throw
        # the prefill's work away, so the prefill waits for the grant and starts with it.
        queued = False  # decode had no room at first: the request waited for it
        moved = False  # to another decode worker that had room
        call: PrefillCall | None = None
        if not plan.decoder.refusing():
            call = start_prefill_call(
                plan.prefill, request_id, prompt_token_ids, params, None, priority
            )
            plan.prefill_call = call
        try:
            await asyncio.sleep(0)
            _open_decode(plan, request_id, prompt_token_ids, params, priority)
            for attempt in range(MAX_DRAIN_RETRIES + 1):
                first = await read_next(plan.decode_stream, plan.decoder)
                waits = first["type"] == "queued"  # (else refused, if it may not wait)
                if not moved and (waits or first.get("code") == NO_CAPACITY):
                    moved = await move_for_room(self.directory, plan, request_id, waits)
                    if moved:  # (it asks there; its prefill goes on, for that grant)
                        _open_decode(plan, request_id, prompt_token_ids, params, priority)
                        first = await read_next(plan.decode_stream, plan.decoder)
                if first["type"] == "queued":  # no KV room now: it waits its turn there
                    queued = True
                    plan.decoder.note_reservation(refused=True)  # (prefills wait for grants)
                    if call is not None:
                        # Its prefill would hold KV pages on the prefill worker while this
                        # waits, and prefills that hold pages for reservations that wait for
                        # room can starve the granted ones of prefill room: it starts again
                        # with its grant.
                        await to_completion(close_calls(call.futures(), None))
                        call = plan.prefill_call = None
                    first = await read_next(plan.decode_stream, plan.decoder)
                if first["type"] != "error":
                    break
                if first.get("code") != DRAINING or attempt == MAX_DRAIN_RETRIES:
                    plan.decoder.note_reservation(refused=first.get("code") == NO_CAPACITY)
                    raise worker_error(first)
                await plan.decode_stream.aclose()
                await move_from_draining(self.directory, plan, "decode")
                _open_decode(plan, request_id, prompt_token_ids, params, priority)
        except BaseException as exc:
            futures = set() if call is None else call.futures()
            # Left before decode's answer came (the client went): a reservation made meanwhile
            # was handed to no prefill worker. (An API error is decode's own refusal, or a
            # broken connection to it.)
            release = None if isinstance(exc, APIError) else unwritten(plan, request_id)
            await to_completion(close_calls(futures, plan.decode_stream, release))
            raise
        if not queued:  # (granted at once: there is room again)
            plan.decoder.note_reservation(refused=False)
        plan.grant = first["grant"]
        if call is None:
            # Nothing started on the prefill worker (closed while the request waited, or
            # decode was refusing): it starts now, with the grant, not when the request runs
            # (the choices of one request run once all are granted: this one's lease would run
            # out meanwhile).
            if plan.prefill.client.closed:  # (its worker died meanwhile: another takes it)
                await move_granted_from_lost(self.directory, plan, request_id)
            call = start_prefill_call(
                plan.prefill, request_id, prompt_token_ids, params, plan.grant, priority
            )
            plan.prefill_call = call
        else:
            call.hand_grant(plan.prefill, request_id, first["grant"])
        plan.grant_handed = True
        timings.mark("reserved")

    async def abandon(self, plan: RoutePlan, request_id: str) -> None:
        """For a reserved request whose `generate` never started (its client left in between):
        closes its calls on the workers and releases its load."""
        call = plan.prefill_call
        pending = set() if call is None else call.futures()
        try:
            await to_completion(
                close_calls(pending, plan.decode_stream, held_blocks_release(plan, request_id))
            )
        finally:
            plan.release()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        timings: RequestTimings,
        plan: RoutePlan,
        priority: int = 0,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """After `reserve`: yields decode's token items; the last carries `finish_reason`.
        Raises APIError. Leaving early cancels the request on its workers."""
        if plan.prefill_only:
            yield await self._finished_on_prefill(
                request_id, prompt_token_ids, params, timings, plan, priority
            )
            return
        stream = plan.decode_stream
        assert stream is not None
        pending: set[asyncio.Future[Any]] = set()
        retries = 0
        # The prefill worker streams the first token as soon as it samples it; decode's first
        # item repeats it (`early` until then), so it is cut from that item.
        early: asyncio.Future[dict[str, Any]] | None = None
        streamed: dict[str, Any] | None = None
        prompt_logprobs: list[Any] | None = None  # from the prefill worker's outcome
        first_out = False
        completed = False
        # Decode sent its own tokens: every page is there, and a prefill worker lost now is
        # no loss to the request (unless its outcome would bring the prompt's logprobs).
        decoding = False
        try:
            prefill_task: asyncio.Future[Any] | None = None
            latest: PrefillCall | None = None

            def start_prefill(call: PrefillCall | None = None) -> asyncio.Future[Any]:
                nonlocal early, latest
                assert plan.prefill is not None
                if early is not None:
                    pending.discard(early)
                    early.cancel()
                if call is None:  # with the grant: nothing started on this worker yet
                    call = start_prefill_call(
                        plan.prefill, request_id, prompt_token_ids, params, plan.grant, priority
                    )
                    plan.grant_handed = True  # (`reserve` set the grant before any `generate`)
                early, latest = call.early, call
                pending.update((early, call.task))
                return call.task

            if plan.prefill is not None:
                prefill_task = start_prefill(plan.prefill_call)
            next_item = asyncio.ensure_future(read_next(stream, plan.decoder))
            pending.add(next_item)
            while True:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if early is not None and early in done:
                    pending.discard(early)
                    if not first_out:
                        first_out = True
                        streamed = early.result()
                        timings.mark("first_token")
                        first_item = {
                            "type": "tokens",
                            "token_ids": streamed["token_ids"],
                            "text": streamed["text"],
                        }
                        if streamed.get("logprobs") is not None:
                            first_item["logprobs"] = streamed["logprobs"]
                        yield first_item
                if prefill_task is not None and prefill_task in done:
                    pending.discard(prefill_task)
                    outcome = prefill_task.result()
                    if outcome.get("code") == DRAINING and retries < MAX_DRAIN_RETRIES:
                        retries += 1  # nothing started there: the grant goes to another worker
                        await move_from_draining(self.directory, plan, "prefill")
                        prefill_task = start_prefill()
                        continue
                    plan.release_prefill()
                    needed = not decoding or "prompt_logprobs" in params
                    if outcome["status"] != "sent" and needed:
                        assert plan.prefill is not None
                        if outcome.get("not_sent") and latest is not None and latest.carries_grant:
                            plan.grant_handed = False  # (decode frees the blocks at once)
                        message = f"prefill failed: {outcome.get('error')}"
                        # (unless that worker is gone itself, its pages may have had nowhere
                        # to go: the request may then start over without the decode worker)
                        if plan.prefill.client.lost_at is None and await lost(
                            plan.decoder, next_item
                        ):
                            raise failed(plan.decoder, message, "decode_failed")
                        raise failed(plan.prefill, message, "prefill_failed")
                    timings.worker.update(outcome.get("timings", {}))
                    prompt_logprobs = outcome.get("prompt_logprobs", prompt_logprobs)
                if next_item not in done:
                    continue
                pending.discard(next_item)
                item = next_item.result()
                if (
                    item["type"] == "error"
                    and item.get("code") == DRAINING
                    and plan.prefill is None  # a local prefill starts with the stream
                    and retries < MAX_DRAIN_RETRIES
                ):
                    retries += 1
                    await stream.aclose()
                    await move_from_draining(self.directory, plan, "decode")
                    stream = _open_decode(plan, request_id, prompt_token_ids, params, priority)
                    next_item = asyncio.ensure_future(read_next(stream, plan.decoder))
                    pending.add(next_item)
                    continue
                if item["type"] == "error":
                    if item.get("code") == SENDER_GONE and plan.prefill is not None:
                        # (its prefill worker died mid-transfer: the request may start over)
                        await lost(plan.prefill, prefill_task)
                        message = f"prefill failed: {item.get('error')}"
                        raise failed(plan.prefill, message, "prefill_failed")
                    raise worker_error(item)
                if not first_out and early is not None:
                    pending.discard(early)  # decode was first: the prefill's copy is not needed
                    early.cancel()
                first_out = decoding = True
                if plan.prefill is None:  # (decode's own prefill is done)
                    plan.release_prefill()
                timings.mark("first_token")
                if streamed is not None:
                    item, streamed = without_streamed(item, streamed), None
                if item.get("finish_reason") is not None:
                    timings.mark("finished")
                    timings.worker.update(item.get("timings", {}))
                    if prefill_task is not None and prefill_task in pending:  # timings, logprobs
                        # (prompt logprobs come with the outcome: it is waited for longer)
                        wait_s = 1.0 if "prompt_logprobs" not in params else 30.0
                        with contextlib.suppress(Exception, asyncio.TimeoutError):
                            outcome = await asyncio.wait_for(asyncio.shield(prefill_task), wait_s)
                            timings.worker.update(outcome.get("timings", {}))
                            prompt_logprobs = outcome.get("prompt_logprobs", prompt_logprobs)
                    if prompt_logprobs is not None:
                        item = {**item, "prompt_logprobs": prompt_logprobs}
                    completed = True  # (decode ended the request: nothing of it is left there)
                    yield item
                    return
                if item["token_ids"] or item["text"]:
                    yield item
                next_item = asyncio.ensure_future(read_next(stream, plan.decoder))
                pending.add(next_item)
        finally:
            if plan.prefill_call is not None:  # (its task and early may be done: no matter)
                pending |= plan.prefill_call.futures()
            try:
                await to_completion(
                    close_calls(
                        pending,
                        stream,
                        None if completed else held_blocks_release(plan, request_id),
                    )
                )
            finally:
                plan.release()

    async def _finished_on_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        timings: RequestTimings,
        plan: RoutePlan,
        priority: int,
    ) -> dict[str, Any]:
        """A one-token request's only item, from its prefill worker (decode is not used)."""
        try:
            for attempt in range(MAX_DRAIN_RETRIES + 1):
                assert plan.prefill is not None and plan.prefill_call is not None
                outcome = await plan.prefill_call.task
                if outcome.get("code") != DRAINING or attempt == MAX_DRAIN_RETRIES:
                    break
                # nothing started there: another one runs it
                await move_from_draining(self.directory, plan, "prefill")
                plan.prefill_call = start_prefill_call(
                    plan.prefill, request_id, prompt_token_ids, params, None, priority, True
                )
            plan.release_prefill()
            assert plan.prefill is not None
            if outcome.get("status") != "finished":
                raise failed(
                    plan.prefill, f"prefill failed: {outcome.get('error')}", "prefill_failed"
                )
            item: dict[str, Any] = outcome["item"]
            timings.mark("first_token")
            timings.mark("finished")
            timings.worker.update(item.get("timings", {}))
            return item
        finally:
            call = plan.prefill_call
            try:
                await to_completion(close_calls(set() if call is None else call.futures(), None))
            finally:
                plan.release()


async def _info(worker: Worker) -> dict[str, Any]:
    try:
        return await worker.client.call("info")
    except RPCError as exc:
        raise unavailable(f"{worker.worker_id}: {exc}", f"{worker.role}_failed") from None


def _open_decode(
    plan: RoutePlan,
    request_id: str,
    prompt_token_ids: list[int],
    params: dict[str, Any],
    priority: int,
) -> AsyncGenerator[dict[str, Any], None]:
    """The request's `generate` call on the plan's decode worker (kept on the plan)."""
    plan.decode_stream = plan.decoder.client.stream(
        "generate",
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        params=params,
        local_prefill=plan.prefill is None,
        priority=priority,
        wait_for_room=plan.wait_for_room,
    )
    return plan.decode_stream
