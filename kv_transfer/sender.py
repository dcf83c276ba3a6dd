"""Prefill side of the KV transfer protocol (DESIGN §5): stream pages as prefill proceeds.

`start` queues the prompt in the prefill engine. After every engine step the sender sends the
blocks that became full since the last step as one chunk (so the first chunk leaves while the
rest of the prompt is still being computed); when the first token is sampled, the last chunk
carries the partial last block, the token and the sampler state. Every block stays pinned until
the receiver acknowledges its chunk (an acknowledgement covers every chunk up to its index; the
receiver sends one, for the last chunk), so no page is reused while a transport may still read it.
A cancel from the receiver, an error reply or a missing acknowledgement releases everything.
While a request's decode worker has heard nothing of it for a third of its reservation's lease
(its prefill waits its turn here, or a step of a busy engine separates its chunks), the sender
renews the lease there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import StepOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer._chunk_maker import ChunkMaker
from tandem.kv_transfer._sender_records import (
    ENDED_UNGRANTED_KEPT,
    Outgoing,
    UnknownRequest,
    check_grant,
)
from tandem.kv_transfer.base import KVTransport, Message
from tandem.kv_transfer.chunk_publisher import ChunkPublisher
from tandem.kv_transfer.events import TransferEvent
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter, TransferError
from tandem.kv_transfer.receiver import ReservationGrant

logger = logging.getLogger(__name__)


class KVSender:
    def __init__(
        self,
        engine: LLMEngine,
        transport: KVTransport,
        *,
        ack_timeout_s: float = 10.0,
        checksums: bool = False,
        clock: Callable[[], float] = time.monotonic,
        hand_off: bool = False,
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.ack_timeout_s = ack_timeout_s
        self.clock = clock
        layout = KVLayout.of_pool(engine.kv_pool, engine.namespace.digest())
        self._chunks = ChunkMaker(engine, layout, checksums=checksums, awaiting_ack=self._told)
        self._block_size = self._chunks.block_size
        self.outgoing: dict[str, Outgoing] = {}
        # Requests that ended before their reservation came (most recent last): a grant that
        # comes for one later is refused, and its decode worker told at once.
        self._ended_ungranted: OrderedDict[str, None] = OrderedDict()
        self._events: list[TransferEvent] = []  # ended outside a poll, reported by the next
        self.send_work_s = 0.0  # time the caller's thread spent handing pages over (not copies
        # a transport makes on its own threads)
        self.num_transfers_done = 0  # requests whose pages all arrived ("sent")
        self.num_transfers_failed = 0  # ended by an error or a timeout (not a cancel)
        transport.register_pool(engine.kv_pool)
        # hand_off: chunks other than a request's last are made and sent on a thread of their
        # own (`ChunkPublisher`); the engine's thread only pins their blocks.
        self._publisher = ChunkPublisher(transport, self._chunks.make) if hand_off else None

    def close(self) -> None:
        """Stops the publishing thread (if any); the transport is the caller's to close."""
        if self._publisher is not None:
            self._publisher.close()

    def _exclusive(self, flush: bool = False) -> contextlib.AbstractContextManager[None]:
        """Within it the publishing thread makes and sends no chunk (it writes the records of
        what it sends: `Outgoing.next_chunk`, `unacked`, `deadline`); `flush`: what it has
        queued is sent first, on this thread."""
        if self._publisher is None:
            return contextlib.nullcontext()
        return self._publisher.exclusive(flush)

    def _drop_queued(self, request_id: str) -> None:
        """Forgets the request's chunks not made yet, and unpins their blocks (never sent)."""
        if self._publisher is not None:
            for _, _, blocks, _ in self._publisher.drop(request_id):
                self.engine.block_manager.unpin(blocks)

    def _stop_and_tell(self, request_id: str, peer: str, kind: str) -> None:
        """Drops the request's pages still queued in the transport, then sends `kind`
        ("cancel": we stopped; "cancelled": we confirm the receiver's stop) to `peer`."""
        self._drop_queued(request_id)
        self.transport.cancel(request_id)
        try:
            self.transport.send(peer, {"type": kind, "request_id": request_id})
        except TransferError as exc:  # best effort: the receiver's lease frees its side anyway
            logger.warning("could not tell %s about %s (%s): %s", peer, request_id, kind, exc)

    def start(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grant: ReservationGrant | None,
        priority: int = 0,
    ) -> None:
        """Queues the prompt for prefill; its pages go to the reservation `grant` describes.
        With no grant yet, prefill runs and its blocks wait (kept) until `attach_grant`.
        `priority` orders the engine's waiting queue (lower first)."""
        if grant is not None:
            check_grant(grant, len(prompt_token_ids), self._block_size)
        self._ended_ungranted.pop(request_id, None)
        prefill_params = params.model_copy(update={"max_tokens": 1, "stop": None})
        req = self.engine.add_request(
            prompt_token_ids, prefill_params, request_id=request_id, keep_kv=True, priority=priority
        )
        self.outgoing[request_id] = Outgoing(
            req,
            params,
            grant,
            next_block=grant.num_hit_blocks if grant else 0,
            told_at=self.clock(),
            fills_context=len(prompt_token_ids) + 1 >= self.engine.max_model_len,
        )

    def attach_grant(self, request_id: str, grant: ReservationGrant) -> None:
        """The reservation of a request started without one: what prefill completed so far
        streams now. A reservation that does not fit the prompt fails the request (ValueError).
        KeyError for a request that is not streaming: `UnknownRequest` if it never started
        here; for one that ended before its reservation came, the decode worker is told."""
        out = self.outgoing.get(request_id)
        if out is None and request_id in self._ended_ungranted:
            self.release_grant(request_id, grant)
            raise KeyError(
                f"the prefill of {request_id!r} ended before its reservation came "
                "(the decode worker is told to release it)"
            )
        if out is None:
            raise UnknownRequest(f"no prefill of {request_id!r} here")
        if out.cancelling:
            raise KeyError(f"the prefill of {request_id!r} is being cancelled")
        if out.grant is not None:
            raise ValueError(f"{request_id!r} already has a reservation")
        try:
            check_grant(grant, out.request.num_prompt_tokens, self._block_size)
        except ValueError as exc:
            self._events.append(self._close(out, "failed", str(exc)))
            raise
        out.grant = grant
        out.next_block = grant.num_hit_blocks
        out.told_at = self.clock()
        self._stream(out)

    def _told(self, out: Outgoing) -> None:
        """`out`'s receiver was just sent a chunk: its acknowledgement is due in time."""
        out.told_at = now = self.clock()
        out.deadline = now + self.ack_timeout_s

    @property
    def layout(self) -> KVLayout:
        """What every manifest declares about the pages (the receiver refuses a mismatch)."""
        return self._chunks.headers.layout

    @layout.setter
    def layout(self, layout: KVLayout) -> None:
        self._chunks.headers = PagesHeaderWriter(layout)

    @property
    def checksums(self) -> bool:
        """Whether every chunk's pages carry a checksum (the receiver verifies it)."""
        return self._chunks.checksums

    @property
    def num_chunks_sent(self) -> int:
        return self._chunks.num_chunks

    @property
    def num_bytes_sent(self) -> int:
        """Page bytes handed to the transport."""
        return self._chunks.num_bytes

    @property
    def has_events(self) -> bool:
        """Something ended outside a poll (a cancel before the reservation) and waits to be
        reported by the next `poll`."""
        return bool(self._events)

    @property
    def awaiting_replies(self) -> bool:
        """Some transfer is under way with a decode worker (acknowledgements will come)."""
        return any(out.grant is not None for out in self.outgoing.values())

    def release_grant(self, request_id: str, grant: ReservationGrant) -> None:
        """Tells `grant`'s decode worker that no page of `request_id` will come: it frees the
        reserved blocks now, not after its stall timeout."""
        self._stop_and_tell(request_id, grant.address, "cancel")

    def cancel(self, request_id: str) -> bool:
        """Prefill-side cancel: stops prefill, tells the receiver, unpins once it acknowledges."""
        out = self.outgoing.get(request_id)
        if out is None or out.cancelling:
            return False
        out.cancelling = True
        if out.grant is None:  # no receiver knows of it yet: nothing to acknowledge
            self._events.append(self._close(out, "cancelled", "cancelled before reservation"))
            return True
        self._stop_and_tell(request_id, out.grant.address, "cancel")
        out.deadline = self.clock() + self.ack_timeout_s
        if not out.request.is_finished:
            self.engine.abort(request_id)
        return True

    def fail(self, request_id: str, error: str) -> bool:
        """Like `cancel` (the receiver is told, pages stay pinned until it acknowledges), but
        the request ends with a `failed` event carrying `error`."""
        out = self.outgoing.get(request_id)
        if out is None:
            return False
        out.failure = error
        return self.cancel(request_id)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[TransferEvent]:
        """One engine step, then streams what it completed and handles replies."""
        return self.compute() + self.stream()

    def compute(self, others: list[StepOutput] | None = None) -> list[TransferEvent]:
        """One engine step: a `first_token` event for each prefill it ended. A caller that
        hands first tokens on before their last pages go calls `stream()` after that. The
        outputs of the engine's requests that have no transfer go to `others` (if given)."""
        events: list[TransferEvent] = []
        for result in self.engine.step():
            out = self.outgoing.get(result.request_id)
            if out is None and others is not None:
                others.append(result)
            elif out is not None and result.finished:
                out.finished = True
                events.append(
                    TransferEvent("first_token", result.request_id, tuple(result.new_token_ids))
                )
        return events

    def stream(self) -> list[TransferEvent]:
        """Sends the pages the steps so far completed, then handles replies."""
        for out in list(self.outgoing.values()):
            if not out.cancelling and not out.last_sent and out.grant is not None:
                self._stream(out)
        return self.poll()

    def take_events(self) -> list[TransferEvent]:
        """The events of requests that ended outside a poll (`has_events`), now."""
        events, self._events = self._events, []
        return events

    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        if self._publisher is not None:
            for rid, error in self._publisher.failures():
                if (out := self.outgoing.get(rid)) is not None:
                    self._events.append(self._close(out, "failed", error))
        events = self.take_events()
        if events:
            timeout = 0.0
        events += [e for m in self.transport.poll(timeout) if (e := self._handle(m)) is not None]
        now = self.clock()
        renew: list[Outgoing] = []
        for out in list(self.outgoing.values()):
            if now > out.deadline:
                what = "cancel acknowledgement" if out.cancelling else "acknowledgement"
                if not out.cancelling and out.grant is not None:  # tell the receiver we stopped
                    self._stop_and_tell(out.request.request_id, out.grant.address, "cancel")
                events.append(
                    self._close(
                        out, "failed", f"no {what} from the decode side in {self.ack_timeout_s}s"
                    )
                )
            elif out.lease_ends_soon(now):
                renew.append(out)
        if renew:
            self._renew(renew, now)
        return events

    def _renew(self, outs: list[Outgoing], now: float) -> None:
        """Tells each request's decode worker that its sender lives and works on it (its
        prefill waits its turn here, or runs between chunks): the reservation's lease is
        extended there instead of expiring."""
        with self._exclusive():  # (not between the publishing thread's sends)
            for out in outs:
                assert out.grant is not None
                out.told_at = now
                rid = out.request.request_id
                self._send(out.grant.address, {"type": "renew", "request_id": rid}, [])

    def _stream(self, out: Outgoing) -> None:
        """Pins the blocks the steps completed since the last chunk and sends them. With a
        publishing thread, which makes and sends every chunk but the last, the engine's thread
        runs only the lines up to `add` (each costs ~1 us here: caches are cold after a step)."""
        start = time.perf_counter()
        try:
            if out.finished:
                self._send_last(out)
                return
            req, first = out.request, out.next_block
            end = req.num_computed_tokens // self._block_size
            if end <= first:
                return
            blocks = req.block_table[first:end]
            self.engine.block_manager.pin(blocks)
            out.next_block = end
            if self._publisher is not None:
                self._publisher.add(req.request_id, (out, first, blocks, False))
                return
            peer, header, blocks = self._chunks.make((out, first, blocks, False))
            if (error := self._send(peer, header, blocks)) is not None:
                self._events.append(self._close(out, "failed", error))
        finally:
            self.send_work_s += time.perf_counter() - start

    def _send_last(self, out: Outgoing) -> None:
        """The last chunk: the partial last block, the first token and the sampler state; it
        goes after every chunk still queued."""
        req, start = out.request, out.next_block
        end = math.ceil(req.num_prompt_tokens / self._block_size)
        blocks = req.block_table[start:end]
        self.engine.block_manager.pin(blocks)
        out.next_block = end
        out.last_sent = True
        with self._exclusive(flush=True):
            peer, header, blocks = self._chunks.make((out, start, blocks, True))
            error = self._send(peer, header, blocks)
        if error is not None:  # (closed outside: `_close` waits for the publishing thread)
            self._events.append(self._close(out, "failed", error))

    def _send(self, peer: str, header: dict[str, Any], blocks: list[int]) -> str | None:
        """Sends a chunk; what went wrong, if it did."""
        try:
            self.transport.send(peer, header, blocks)
        except TransferError as exc:  # e.g. an address the transport cannot reach
            return f"could not send the pages: {exc}"
        return None

    def _handle(self, message: Message) -> TransferEvent | None:
        header = message.header
        kind = header.get("type")
        rid = str(header.get("request_id", ""))
        if kind == "error":  # confirm we stopped, so the receiver may reuse the blocks it held
            self._stop_and_tell(rid, message.peer, "cancelled")
        out = self.outgoing.get(rid)
        if out is None:
            return None
        if kind == "ack" and not out.cancelling:  # cumulative: chunks up to this one arrived
            acked = int(header.get("chunk_index", -1))
            # No lock: the publishing thread may add a later chunk to `unacked` meanwhile (a
            # snapshot of its keys is taken at once; dict operations are atomic), and a deadline
            # it sets may be overwritten here, but the last chunk, sent from this thread after
            # all queued ones, sets it again. The engine's thread never waits for a slow send.
            for index in [i for i in list(out.unacked) if i <= acked]:
                self.engine.block_manager.unpin(out.unacked.pop(index))
            out.deadline = self.clock() + self.ack_timeout_s if out.unacked else math.inf
            return self._close(out, "sent") if out.last_sent and not out.unacked else None
        if kind == "cancelled":
            return self._close(out, "cancelled", "cancelled by prefill")
        if kind == "cancel":
            self._stop_and_tell(out.request.request_id, message.peer, "cancelled")
            return self._close(out, "cancelled", str(header.get("reason", "cancelled by decode")))
        if kind in ("error", "transport_error"):
            return self._close(out, "failed", str(header.get("error", "transfer error")))
        return None

    def _close(self, out: Outgoing, kind: str, error: str | None = None) -> TransferEvent:
        """Unpins everything in flight and gives the request's blocks back to the engine."""
        rid = out.request.request_id
        if out.failure is not None and kind == "cancelled":
            kind, error = "failed", out.failure
        del self.outgoing[rid]
        if out.grant is None:
            self._ended_ungranted[rid] = None
            if len(self._ended_ungranted) > ENDED_UNGRANTED_KEPT:
                self._ended_ungranted.popitem(last=False)
        if not out.last_sent:  # (none of its chunks may be sent once unpinned; the last chunk
            self._drop_queued(rid)  # sent what was queued, so nothing is left to wait for)
        for blocks in out.unacked.values():
            self.engine.block_manager.unpin(blocks)
        if rid in self.engine.requests:
            self.engine.abort(rid)
        if error:
            logger.info("KV transfer of %s ended (%s): %s", rid, kind, error)
        if kind == "sent":
            self.num_transfers_done += 1
        elif kind == "failed":
            self.num_transfers_failed += 1
        return TransferEvent(kind, rid, error=error)  # type: ignore[arg-type]
