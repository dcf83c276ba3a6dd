"""Decode side of the KV transfer protocol (DESIGN §5): reserve, receive chunks, commit.

1. `reserve` allocates blocks for a request's prompt under a lease; full blocks the decode
   engine already caches are reused (decode-side prefix reuse) and only the rest is asked for.
2. Each `pages` message must be the next chunk of a live reservation from the peer that started
   it, land exactly on the next reserved blocks, and carry this engine's KV layout; anything else
   fails the request (duplicates of an already accepted chunk are acknowledged and ignored).
3. The last chunk carries the first token and sampler state and commits the request into the
   decode engine's running batch. Its acknowledgement covers every chunk before it (the chunks
   arrive in order), so a stream costs the sender's engine thread one reply, not one per chunk.
4. Cancel from either side releases the reservation and is acknowledged; a reservation that sees
   no chunk within its lease, or whose stream stalls, is released by itself. Its sender renews
   the lease (a ``renew`` message) while its prefill waits its turn or computes between chunks,
   so a long prefill queue does not expire it; a dead sender stops renewing. One whose grant the
   router never handed to a prefill worker is released at once (`release_unwritten`).

Transports may write pages straight into the pool before this side reads the manifest (shm, torch
and ucx do). So blocks given up while the sender may still be streaming (decode-side cancel, a
refused chunk, lease expiry, a stall, a broken link) are *held* until the sender confirms it
stopped (its ``cancelled`` reply, which the transport's FIFO order delivers after any pages it
sent before) or `stall_timeout_s` passes; only then do they return to the engine, so no page is
reused while in flight. `block_tables()` lists held blocks too.

Such a write is also why a chunk the protocol refuses (or one for an unknown reservation, or
from another sender) is not only refused: blocks its pages may have landed in outside what its
sender was asked to write leave the prefix cache, and the requests holding them fail
(`_overwrites`).

A sender whose process died writes nothing more: a transport that knows it (shm, torch and ucx
on one machine, `_peer_process`; local) delivers a ``peer_gone`` message after the last of that
peer's messages. Blocks held for that sender go back at once, and its live reservations fail.
Held blocks whose sender was never heard from (no page came) are tied to it when the router
names the prefill worker it handed the grant to and lost (`release_from_lost_sender`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from pydantic import ValidationError

from tandem.engine.hashing import hash_full_blocks
from tandem.engine.kv_io import NoFreeBlocksError, commit_request
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer._held_blocks import HeldBlocks
from tandem.kv_transfer._last_chunk import chunk_problem, first_logprobs
from tandem.kv_transfer._overwrites import direct_destinations, holders
from tandem.kv_transfer._receiver_records import Held, Reservation, ReservationGrant
from tandem.kv_transfer.base import KVTransport, Message
from tandem.kv_transfer.events import SENDER_GONE, TransferEvent
from tandem.kv_transfer.manifest import (
    ChunkManifest,
    KVLayout,
    ManifestMismatchError,
    TransferError,
    decode_state,
)

logger = logging.getLogger(__name__)


class KVReceiver:
    def __init__(
        self,
        engine: LLMEngine,
        transport: KVTransport,
        *,
        lease_s: float = 30.0,
        stall_timeout_s: float = 10.0,
        verify_checksums: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.lease_s = lease_s
        self.stall_timeout_s = stall_timeout_s
        self.verify_checksums = verify_checksums
        self.clock = clock
        self.layout = KVLayout.of_pool(engine.kv_pool, engine.namespace.digest())
        self.reservations: dict[str, Reservation] = {}
        self.held = HeldBlocks(engine.block_manager.free)  # (ended, unconfirmed: see above)
        transport.register_pool(engine.kv_pool)

    # ---- reservations ---------------------------------------------------------------------------
    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> ReservationGrant:
        """Allocates the prompt's blocks (reusing cached full blocks) under a lease."""
        engine = self.engine
        if request_id in self.reservations or request_id in engine.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        bs = engine.config.block_size
        hashes = hash_full_blocks(
            engine.namespace.request_root(params.cache_salt), prompt_token_ids, bs
        )
        bm = engine.block_manager
        # (counted once, when reserved: a reservation that waits for room is tried again)
        hits = bm.match_prefix(hashes, prompt_token_ids, record=False)
        table: list[int] = []
        if not bm.allocate(table, len(prompt_token_ids), hits):
            # (no request id: the router's is not the one its client knows)
            raise NoFreeBlocksError(f"no room for {len(prompt_token_ids)} prompt tokens")
        if bm.enable_prefix_caching:
            bm.record_lookup(min(len(hashes), len(prompt_token_ids) // bs), len(hits))
        self.reservations[request_id] = Reservation(
            request_id,
            list(prompt_token_ids),
            params,
            table,
            hashes,
            len(hits),
            deadline=self.clock() + self.lease_s,
            next_block=len(hits),
        )
        return ReservationGrant(
            request_id, self.transport.address, table[len(hits) :], len(hits), self.lease_s
        )

    def cancel(self, request_id: str, reason: str = "cancelled by decode") -> bool:
        """Decode-side cancel: releases the reservation and tells the sender (if it started)."""
        res = self.reservations.pop(request_id, None)
        if res is None:
            return False
        self._hold(res, cancel_reason=reason)
        if res.peer is not None:
            self._tell_cancel(res.peer, request_id, reason)
        return True

    def release_unwritten(self, request_id: str) -> int:
        """The router says no sender was ever given `request_id`'s grant (it never went out,
        or the prefill worker refused it): held blocks that no pages reached go back to the
        engine now instead of after `stall_timeout_s`. Returns how many blocks were released.
        A live reservation is left alone: `cancel` it first."""
        return self.held.unwritten(request_id)

    def release_from_lost_sender(self, request_id: str, sender: str) -> int:
        """The router handed `request_id`'s grant to the prefill worker whose KV address is
        `sender`, and lost it: held blocks of the request that no page reached are that
        sender's. They go back now if the transport reported it gone, else when it does (or
        after `stall_timeout_s`, as before). Returns how many blocks were released now."""
        return self.held.from_lost_sender(request_id, sender)

    @property
    def busy(self) -> bool:
        """Whether messages are expected: live reservations, or held blocks awaiting the
        sender's confirmation (the owner must keep calling `poll` while this is True)."""
        return bool(self.reservations or self.held)

    def block_tables(self) -> list[list[int]]:
        """Block tables held by reservations, and by ended ones not yet confirmed by their
        sender (for integrity checks next to the engine's)."""
        return [r.block_table for r in self.reservations.values()] + [
            h.block_table for h in self.held
        ]

    # ---- message loop -------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        events: list[TransferEvent] = []
        for message in self.transport.poll(timeout):
            try:
                events.extend(self._on_message(message))
            except Exception as exc:  # (a defect must not stop the decode worker's loop)
                events.extend(self._contain(message, exc))
        events.extend(self._expire())
        if self.held:
            self.held.expired(self.clock())
        return events

    def _on_message(self, message: Message) -> list[TransferEvent]:
        kind = message.header.get("type")
        if kind == "peer_gone":
            return self._sender_gone(message.peer)
        if kind == "pages":
            return self._on_pages(message)
        event = self._handle(message, kind)
        return [] if event is None else [event]

    def _contain(self, message: Message, exc: Exception) -> list[TransferEvent]:
        """A message whose handling raised: the reservation it names fails (its blocks are
        held as any failed one's), and the loop serves on."""
        request_id = str(message.header.get("request_id", ""))
        logger.exception("KV message %r for %r failed", message.header.get("type"), request_id)
        res = self.reservations.get(request_id)
        if res is None or (res.peer is not None and res.peer != message.peer):
            return []
        return [self._fail(res, f"internal error on its KV message: {exc!r}")]

    def _handle(self, message: Message, kind: Any) -> TransferEvent | None:
        request_id = str(message.header.get("request_id", ""))
        if kind == "renew":  # its sender lives and works on it: the lease runs on
            res = self.reservations.get(request_id)
            if res is not None and res.peer in (None, message.peer):
                res.deadline = max(res.deadline, self.clock() + self.lease_s)
            return None
        if kind in ("cancel", "cancelled"):  # the sender stopped: nothing more is in flight
            self.held.stopped(request_id, message.peer)
        if kind == "cancel":
            res = self.reservations.pop(request_id, None)
            if res is not None:
                self.engine.block_manager.free(res.block_table)
            self._send(message.peer, {"type": "cancelled", "request_id": request_id})
            return (
                TransferEvent("cancelled", request_id, error="cancelled by prefill")
                if res
                else None
            )
        if kind == "transport_error":
            res = self.reservations.get(request_id)
            if res is not None:
                return self._fail(
                    res, f"transport error: {message.header.get('error')}", notify=False
                )
        return None

    def _sender_gone(self, peer: str) -> list[TransferEvent]:
        """`peer` can write nothing more (its process is gone, and the transport delivered all
        it had sent): its held blocks go back, its live reservations fail."""
        held = self.held.sender_gone(peer)
        lost = [r for r in self.reservations.values() if r.peer == peer]
        if held or lost:
            logger.info(
                "KV sender %s is gone: %d held and %d live reservations released (%d blocks)",
                peer,
                len(held),
                len(lost),
                sum(len(h.block_table) for h in held) + sum(len(r.block_table) for r in lost),
            )
        return [self._fail(r, "its sender is gone", sender_gone=True) for r in lost]

    def _on_pages(self, message: Message) -> list[TransferEvent]:
        """A chunk taken or refused; pages its transport wrote where the chunk had no right to
        (`_overwrites`) fail the requests that hold those blocks."""
        request_id = str(message.header.get("request_id", ""))
        event, own = self._take_pages(message, request_id)
        events = [event] if event is not None else []
        foreign = direct_destinations(message, self.engine.kv_pool.num_blocks).difference(own)
        if foreign:
            events += self._overwritten(foreign, f"a refused chunk of {request_id}")
        return events

    def _take_pages(
        self, message: Message, request_id: str
    ) -> tuple[TransferEvent | None, Collection[int]]:
        """The chunk's event, and the blocks the message had a right to write."""
        res = self.reservations.get(request_id)
        if res is None:
            reason = self.held.cancel_reason(request_id, message.peer)
            if reason is not None:  # cancelled here before its first pages: a cancel, no error
                self._tell_cancel(message.peer, request_id, reason)
            else:
                self._reply_error(
                    message.peer, request_id, "unknown, expired or cancelled reservation"
                )
            return None, self.held.writable(request_id, message.peer)
        if res.peer is not None and res.peer != message.peer:
            self._reply_error(message.peer, request_id, "reservation belongs to another sender")
            return None, ()
        try:
            manifest = ChunkManifest.model_validate(message.header.get("manifest"))
            manifest.layout.check_matches(self.layout)
        except (ValidationError, ManifestMismatchError) as exc:
            res.peer = message.peer
            return self._fail(res, f"refused manifest: {exc}"), res.writable
        res.peer = message.peer
        if manifest.chunk_index < res.next_chunk:  # a duplicate of an accepted chunk
            accepted = res.chunk_blocks(manifest.chunk_index)
            if manifest.dst_block_ids != accepted:
                why = (
                    f"chunk {manifest.chunk_index} came again for blocks "
                    f"{manifest.dst_block_ids}, not {accepted}"
                )
                return self._fail(res, why), res.writable
            self._ack(res, manifest.chunk_index)
            return None, accepted
        problem = chunk_problem(self.engine, res, manifest, message, self.verify_checksums)
        if problem:
            return self._fail(res, problem), res.writable
        if message.pages is not None and manifest.dst_block_ids:
            self.engine.kv_pool.import_blocks(manifest.dst_block_ids, message.pages)
        res.next_block += len(manifest.dst_block_ids)
        res.chunk_ends.append(res.next_block)
        res.next_chunk += 1
        res.deadline = self.clock() + self.stall_timeout_s
        if not manifest.last:  # acknowledged with the last one (an ack covers all before it)
            return None, manifest.dst_block_ids
        return self._commit(res, manifest, message.header), manifest.dst_block_ids

    def _overwritten(self, blocks: set[int], by: str) -> list[TransferEvent]:
        """`blocks` hold pages `by` wrote: they leave the prefix cache, and the reservations
        and requests holding them fail."""
        why = f"its KV pages were overwritten by {by}"
        logger.error("KV blocks %s were overwritten by %s", sorted(blocks), by)
        self.engine.block_manager.forget(blocks)
        tables = [(r.request_id, r.block_table) for r in self.reservations.values()]
        events = [self._fail(self.reservations[rid], why) for rid in holders(blocks, tables)]
        running = [(rid, req.block_table) for rid, req in self.engine.requests.items()]
        for rid in holders(blocks, running):
            self.engine.abort(rid)
            events.append(TransferEvent("failed", rid, error=why))
        return events

    def _commit(
        self, res: Reservation, manifest: ChunkManifest, header: dict[str, Any]
    ) -> TransferEvent:
        assert res.peer is not None
        first = tuple(manifest.first_token_ids)
        logprobs = first_logprobs(res, manifest, header)
        if header.get("finished"):
            # (its pages are whole: cached, the conversation's next turn reuses them)
            bm = self.engine.block_manager
            bm.cache_blocks(
                res.block_table, res.block_hashes, res.prompt_token_ids, res.num_hit_blocks
            )
            del self.reservations[res.request_id]  # (ended: `_contain` fails one that raised)
            bm.free(res.block_table)
            self._ack(res, manifest.chunk_index)
            return TransferEvent("finished_early", res.request_id, first, logprobs=logprobs)
        try:
            req = commit_request(
                self.engine,
                res.request_id,
                res.prompt_token_ids,
                list(manifest.first_token_ids),
                res.params,
                res.block_table,
                num_hit_blocks=res.num_hit_blocks,
                sampler_state=decode_state(manifest.sampler_state),
                matcher=res.matcher,
            )
        except (RuntimeError, ValueError) as exc:  # (what `last_chunk_problem` cannot foresee)
            return self._fail(res, f"could not commit: {exc}")
        del self.reservations[res.request_id]  # (the engine's request owns its blocks now)
        if logprobs is not None:
            req.logprobs = list(logprobs)
        self._ack(res, manifest.chunk_index)
        return TransferEvent("committed", res.request_id, first, logprobs=logprobs)

    def _expire(self) -> list[TransferEvent]:
        now = self.clock()
        expired = [r for r in self.reservations.values() if now > r.deadline]
        events = []
        for res in expired:
            why = (
                "lease expired before any page arrived"
                if res.next_chunk == 0
                else "transfer stalled"
            )
            events.append(self._fail(res, why))
        return events

    def _fail(
        self,
        res: Reservation,
        error: str,
        *,
        notify: bool = True,
        sender_gone: bool = False,
    ) -> TransferEvent:
        """Ends `res` as failed. Its blocks are held (see the module docstring) unless its
        sender's process is gone (`SENDER_GONE`); `notify`: tell the sender (not over a link
        that broke: a broken link does not mean a sender that writes nothing more, and the
        transport may still deliver what it wrote)."""
        logger.warning("KV transfer of %s failed: %s", res.request_id, error)
        self.reservations.pop(res.request_id, None)
        if sender_gone:
            self.engine.block_manager.free(res.block_table)
        else:
            self._hold(res)
        if notify and not sender_gone and res.peer is not None:
            self._reply_error(res.peer, res.request_id, error)
        code = SENDER_GONE if sender_gone else None
        return TransferEvent("failed", res.request_id, error=error, code=code)

    def _hold(self, res: Reservation, cancel_reason: str | None = None) -> None:
        deadline = self.clock() + self.stall_timeout_s
        self.held.add(Held.of(res, deadline, cancel_reason))

    def _ack(self, res: Reservation, chunk_index: int) -> None:
        assert res.peer is not None
        self._send(
            res.peer, {"type": "ack", "request_id": res.request_id, "chunk_index": chunk_index}
        )

    def _tell_cancel(self, peer: str, request_id: str, reason: str) -> None:
        self._send(peer, {"type": "cancel", "request_id": request_id, "reason": reason})

    def _reply_error(self, peer: str, request_id: str, error: str) -> None:
        self._send(peer, {"type": "error", "request_id": request_id, "error": error})

    def _send(self, peer: str, header: dict[str, Any]) -> None:
        """Best effort (a closed transport, an address it cannot reach): the sender's own
        timeouts end its side, and the events of this `poll` are not lost."""
        try:
            self.transport.send(peer, header)
        except TransferError as exc:
            logger.warning("could not send %s to %s: %s", header.get("type"), peer, exc)
