"""The prefill role without Ray: an engine, a `KVSender` and an async API around them.

`prefill()` queues a prompt for chunked prefill (continuous batching with everything else the
engine holds), streams its pages to the decode worker named in the reservation grant, and
resolves once every chunk is acknowledged (or the transfer failed or was cancelled). When the
caller asks for it, the first token (ids and text) goes out as soon as it is sampled, before the
last pages are acknowledged: the router streams it while decode takes the request over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.engine_stats import engine_queue_stats, scheduling_stages
from tandem.engine.errors import StepFailedError
from tandem.engine.guided import compile_ahead
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.output_text import OutputText
from tandem.engine.outputs import StepOutput
from tandem.engine.prefill_rate import PrefillRate
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_loop import WorkerLoop, resolve
from tandem.kv_transfer.base import KVTransport
from tandem.kv_transfer.events import TransferEvent
from tandem.kv_transfer.receiver import ReservationGrant
from tandem.kv_transfer.sender import KVSender, UnknownRequest
from tandem.prefill_workers.finishing_here import FinishingHere

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[dict[str, Any]]
    started: float  # when the call started on the loop thread
    first_token_at: float | None = None
    first_token_ids: list[int] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # queue_s, prefix_lookup_s
    first_token: asyncio.Future[dict[str, Any] | None] | None = None
    prompt_logprobs: list[Any] | None = None  # when the request asks


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Marks an outcome nobody awaits as seen (no "exception was never retrieved" log)."""
    if not future.cancelled():
        future.exception()


def _failed(error: str) -> dict[str, Any]:
    """A prefill call's outcome when the worker could not finish it."""
    return {"status": "failed", "first_token_ids": [], "error": error}


EARLY_GRANT_S = 60.0
"""How long a reservation that came before its prefill call waits for it."""


class PrefillService(WorkerLoop):
    """Thread-confined engine + sender; every public coroutine is safe to call from asyncio."""

    def __init__(
        self,
        engine: LLMEngine,
        transport: KVTransport,
        *,
        ack_timeout_s: float = 10.0,
        checksums: bool = False,
        hand_off: bool = True,
        name: str = "prefill",
        on_stats: Any = None,
    ) -> None:
        super().__init__(name, on_stats)
        self.engine = engine
        self.transport = transport
        # Chunks leave from a thread of their own, off the first token's path (`ChunkPublisher`),
        # unless `hand_off` is off.
        self.sender = KVSender(
            engine, transport, ack_timeout_s=ack_timeout_s, checksums=checksums, hand_off=hand_off
        )
        self._pending: dict[str, _Pending] = {}
        self._early_grants: dict[str, tuple[ReservationGrant, float]] = {}  # (loop thread)
        self._here: dict[str, FinishingHere] = {}  # requests that end here (loop thread)
        self.num_cancelled = 0
        self.num_failed = 0
        self.prefill_rate = PrefillRate()
        if engine.config.enable_kv_events:
            self.publish_kv_events(engine.block_manager, engine.namespace.digest())

    @property
    def address(self) -> str:
        return self.transport.address

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grant: ReservationGrant | None,
        priority: int = 0,
        first_token: asyncio.Future[dict[str, Any] | None] | None = None,
        finish_here: bool = False,
    ) -> dict[str, Any]:
        """Prefills and streams; returns {status: sent|failed|cancelled, first_token_ids, error,
        timings} (or "finished" and the token "item": `finish_here`). Cancelling the awaiting
        task cancels the request (and tells decode). See `begin` for the arguments."""
        await compile_ahead(self.engine.grammars, params)
        future = self.begin(
            request_id, prompt_token_ids, params, grant, priority, first_token, finish_here
        )
        return await self.outcome(request_id, future)

    def begin(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grant: ReservationGrant | None,
        priority: int = 0,
        first_token: asyncio.Future[dict[str, Any] | None] | None = None,
        finish_here: bool = False,
    ) -> asyncio.Future[dict[str, Any]]:
        """Queues the request now (an `attach_grant` queued after this finds it); await its
        outcome with `outcome`. With `grant=None`, prefill runs while decode reserves and the
        pages go out once `attach_grant` brings the reservation. With `finish_here` (and no
        grant) the request runs to its end here and nothing is sent (`finishing_here`).

        `first_token`, if given, gets {"token_ids", "text"} as soon as the first token is
        sampled, or None when it cannot be streamed from here: the request has stop strings
        (decode may hold text back) or the first token already ends it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()

        if finish_here and grant is not None:
            raise ValueError("a request that ends on the prefill worker takes no reservation")

        def start() -> None:
            if finish_here:
                self._start_here(request_id, prompt_token_ids, params, priority, future)
                return
            started = time.time()  # (before the engine's request exists: its stages follow)
            early = self._early_grants.pop(request_id, None)
            try:
                self.sender.start(request_id, prompt_token_ids, params, grant, priority)
            except Exception as exc:
                if grant is not None:
                    self._refused(request_id, grant)
                resolve(loop, future, exc)
                return
            self._pending[request_id] = _Pending(loop, future, started, first_token=first_token)
            if early is not None and grant is None:
                with contextlib.suppress(KeyError, ValueError):  # (a misfit fails the request)
                    self.sender.attach_grant(request_id, early[0])

        self.post(start)
        return future

    async def outcome(
        self, request_id: str, future: asyncio.Future[dict[str, Any]]
    ) -> dict[str, Any]:
        """Awaits what `begin` returned; cancelling this cancels the request."""
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.cancel(request_id, future)
            raise

    def cancel(self, request_id: str, future: asyncio.Future[dict[str, Any]]) -> None:
        """Cancels the request `begin` started (and returned `future` for). Commands run in
        order: this one after `begin`'s start, before whatever is posted after it (a new start
        of the same request id). `future`'s outcome is not awaited any more."""
        future.add_done_callback(_retrieved)
        self.post(lambda: self._cancel(request_id, future))

    async def attach_grant(self, request_id: str, grant: ReservationGrant) -> None:
        """The decode worker's reservation for a prefill started without one. One that comes
        before its prefill call (the router's two calls can cross on their way) is kept for
        it, `EARLY_GRANT_S` at most (then its decode worker is told to release it). One that
        comes after its prefill ended (the client left) is refused with KeyError, and its
        decode worker told: it frees the blocks now, not after its stall timeout."""
        await self.submit(lambda: self._attach_grant(request_id, grant))

    def _attach_grant(self, request_id: str, grant: ReservationGrant) -> None:
        sender = self.sender
        with contextlib.suppress(UnknownRequest):  # (not started yet: kept for its call, below)
            sender.attach_grant(request_id, grant)  # (KeyError for an ended one: decode is told)
            return
        now = time.monotonic()
        for rid, (stale, since) in list(self._early_grants.items()):
            if now - since > EARLY_GRANT_S:  # (its prefill never came: the router gave up)
                del self._early_grants[rid]
                sender.release_grant(rid, stale)
        self._early_grants[request_id] = (grant, now)

    def _refused(self, request_id: str, grant: ReservationGrant) -> None:
        """A call that brought decode's grant failed to start: no page will come, so decode
        frees the reservation now (not after its stall timeout). Not while a call of the same
        id streams to a reservation (a duplicate call: that one's transfer goes on)."""
        running = self.sender.outgoing.get(request_id)
        if running is None or running.grant is None:
            self.sender.release_grant(request_id, grant)

    def _start_here(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        future: asyncio.Future[dict[str, Any]],
    ) -> None:
        loop = future.get_loop()
        try:
            req = self.engine.add_request(
                prompt_token_ids, params, request_id=request_id, stream_text=True, priority=priority
            )
        except Exception as exc:
            resolve(loop, future, exc)
            return
        self._here[request_id] = FinishingHere(loop, future, req)

    def _cancel(self, request_id: str, future: asyncio.Future[Any] | None = None) -> bool:
        """Cancels `request_id` (only the call that `future` is the outcome of, if given: not a
        newer one of the same id)."""
        pending = self._pending.get(request_id) or self._here.get(request_id)
        if future is not None and pending is not None and pending.future is not future:
            return False
        if self._here.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self.num_cancelled += 1
            return True
        if request_id not in self.sender.outgoing or not self.sender.cancel(request_id):
            return False
        # A cancel before the reservation ends the request now: its event goes out now too,
        # not with the next step's, which a new call for the same request id (the router
        # starts it again with its grant) may precede: that event would end the new call.
        for event in self.sender.take_events():
            self._on_event(event)
        return True

    # ---- the loop thread -----------------------------------------------------------------------
    def run_once(self) -> None:
        if self.engine.has_unfinished_requests():
            events = self._timed_step()
        elif self.sender.awaiting_replies:
            events = self.sender.poll(timeout=0.001)
        elif self.sender.has_events:
            events = self.sender.poll()
        else:  # idle, or prefilled and waiting for reservations: commands wake it at once
            self.wait_for_command()
            return
        for event in events:
            self._on_event(event)

    def _timed_step(self) -> list[TransferEvent]:
        """One step, measuring prompt tokens computed per second (for admission control).
        First tokens go to their callers before the step's pages are handed to the transport."""
        start = time.perf_counter()
        others: list[StepOutput] = []
        first_tokens = self.sender.compute(others)
        elapsed = time.perf_counter() - start
        for event in first_tokens:
            self._on_event(event)
        if self._end_here(others) or first_tokens:
            # Drop the GIL once, so the event loop's thread (woken by `resolve`) sends the
            # first tokens on now, not after this thread's pages, events and stats work.
            time.sleep(0)
        self.prefill_rate.add(self.engine.last_step_tokens, elapsed)
        return self.sender.stream()

    def _end_here(self, outputs: list[StepOutput]) -> bool:
        """Hands the outcome of each request that ended here to its caller; whether any did."""
        ended = False
        for output in outputs:
            here = self._here.get(output.request_id)
            if here is not None and (outcome := here.add(output)) is not None:
                del self._here[output.request_id]
                resolve(here.loop, here.future, outcome)
                ended = True
        return ended

    def _on_event(self, event: TransferEvent) -> None:
        if event.kind == "cancelled":  # by the router (here) or by decode (over the transport)
            self.num_cancelled += 1
        elif event.kind == "failed":  # e.g. decode dropped the reservation first
            self.num_failed += 1
        pending = self._pending.get(event.request_id)
        if pending is None:
            return
        now = time.time()
        if event.kind == "first_token":
            pending.first_token_at = now
            pending.first_token_ids = list(event.token_ids)
            req = self.engine.requests.get(event.request_id)
            pending.stages = scheduling_stages(req) if req is not None else {}
            if req is not None and req.prompt_logprobs is not None:
                pending.prompt_logprobs = list(req.prompt_logprobs)
            if pending.first_token is not None:
                resolve(pending.loop, pending.first_token, self._first_token_item(event))
            return
        del self._pending[event.request_id]
        if pending.first_token is not None:
            resolve(pending.loop, pending.first_token, None)
        first = pending.first_token_at or now
        status = event.kind if event.kind in ("sent", "cancelled") else "failed"
        outcome = {
            "status": status,
            "first_token_ids": pending.first_token_ids,
            "error": event.error,
            "timings": {
                **pending.stages,
                "prefill_s": max(0.0, first - pending.started - sum(pending.stages.values())),
                "transfer_tail_s": now - first,
            },
        }
        if pending.prompt_logprobs is not None:
            outcome["prompt_logprobs"] = pending.prompt_logprobs
        resolve(pending.loop, pending.future, outcome)

    def _first_token_item(self, event: TransferEvent) -> dict[str, Any] | None:
        """The first token as decode will stream it, if it does not end the request."""
        out = self.sender.outgoing.get(event.request_id)
        if out is None or out.params.stop or out.first_token_ends(self.engine.tokenizer):
            return None
        text = OutputText.after(
            self.engine.tokenizer,
            out.request.prompt_token_ids,
            event.token_ids,
            params=out.params,
        )
        item: dict[str, Any] = {"token_ids": list(event.token_ids), "text": text.text}
        if out.request.logprobs is not None:
            item["logprobs"] = out.request.logprobs[: len(event.token_ids)]
        return item

    def stats(self) -> dict[str, Any]:
        bm = self.engine.block_manager
        return {
            "role": "prefill",
            "address": self.transport.address,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_requests": len(self.engine.requests),
            "num_transfers": len(self.sender.outgoing),
            "kv_transfer_bytes": self.sender.num_bytes_sent,
            "kv_transfers_done": self.sender.num_transfers_done,
            "kv_transfers_failed": self.sender.num_transfers_failed,
            **engine_queue_stats(self.engine),
            "prefix_cache_queried_blocks": bm.prefix_cache_stats.queried_blocks,
            "prefix_cache_hit_blocks": bm.prefix_cache_stats.hit_blocks,
            "num_cancelled": self.num_cancelled,
            "num_step_failures": self.num_step_failures,
            "num_failed": self.num_failed,
            "num_waiting_tokens": sum(
                r.num_tokens - r.num_computed_tokens for r in self.engine.requests.values()
            ),
            "prefill_tokens_per_s": round(self.prefill_rate.tokens_per_s or 0.0, 1),
        }

    def on_step_failed(self, exc: StepFailedError) -> None:
        for rid in exc.request_ids:
            if (here := self._here.pop(rid, None)) is not None:
                self.engine.abort(rid)
                resolve(here.loop, here.future, _failed(f"prefill worker: {exc}"))
            elif rid in self.sender.outgoing:
                self.sender.fail(rid, f"prefill worker: {exc}")
            else:
                self.engine.abort(rid)
        self.engine.check_integrity()

    def on_death(self, exc: BaseException) -> None:
        for rid, pending in list(self._pending.items()):
            resolve(pending.loop, pending.future, _failed(f"prefill worker died: {exc}"))
            del self._pending[rid]
        for here in self._here.values():
            resolve(here.loop, here.future, _failed(f"prefill worker died: {exc}"))
        self._here.clear()

    def close(self) -> None:
        self.stop()
        self.sender.close()
        self.transport.close()
