"""UCX transport (ucxx low-level API): worker-address endpoints, tag messages, own polling thread.

What goes on the wire (tags, frames, lanes): `_ucx_frames.py`. A link sends a hello with the
cluster token and, where this endpoint pulls, a description of its pool; once the peer welcomes
it (over its own link to us; the welcome says whether the peer reads our pages) header frames
follow. Without the token no welcome comes, frames are received into 1 byte (UCX truncates
them), and nothing is read or received for them. Pages land in the pool (`pages is None`,
`header["direct"]` True) when the header's `manifest.dst_block_ids` are one run and shape and
dtype match, as with the shm and torch transports (a sender opts out with `header["direct"] =
False`), else in a new tensor (`header["direct"]` False). That happens before the protocol sees
the manifest: the receiver holds blocks of ended reservations until the sender confirms it
stopped (`receiver.py`).

**Pull** (`pull`, on at both ends by default): between two processes of one machine the header
frame names the runs of source blocks, and the receiver's thread copies them out of the sender's
pool with cross-memory attach (`_cross_memory`) as it takes the frame. The sender's threads do
nothing for the pages, so a prefill engine computing its next chunk keeps its GIL and its core.
Not UCX's own RMA: without UCX error handling (the only mode that keeps shared memory and CMA)
a copy that fails, as when the peer dies during it, aborts the process; here it fails that
message, and the sender is reported gone. Between machines, or where either end does not pull,
UCX moves the pages (pushed): a peer that dies during one of UCX's copies on one machine still
takes the other process down (docs/benchmarks.md, session 49).

Speed (docs/benchmarks.md): one thread per transport makes the UCX calls (`send` queues, but sends
a pull link's frame itself when nothing is queued before it) and *polls* (UCX's WAKEUP feature
halves its shared-memory throughput here): it steps without pausing while there is work, then
pauses up to `idle_sleep_s`, and `slow_sleep_s` (5x unless given) once idle for a while; a
send-only endpoint (a prefill worker's) pauses `quiet_sleep_s` while nothing of its own is under
way. Where every sender it hears from has rung its doorbell (`_doorbell`; they pull, so they run
here) it sleeps on the bell instead, up to `RUNG_SLEEP_S` (`_rung_only`); from a request's last
chunk until its ack it does neither (`_ucx_replies`). `allocate_pool` gives pools on
transparent huge pages (cross-memory copies pin pages one at a time). An idle second endpoint
with UCX error handling reports a dead peer at once. Lost links, no welcome in
`hello_timeout_s`, sends or page receives not done in `send_timeout_s` come back from `poll()`
as `transport_error`s; a sender on this machine whose process ended is reported ``peer_gone``
within `GONE_CHECK_S` (and a sleep on the bell). At most `max_inflight` messages per peer (32)
are handed to UCX at once. `ucx_config` adds UCX options.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _cross_memory
from tandem.kv_transfer._doorbell import Doorbell, bell_name
from tandem.kv_transfer._hugepages import allocate_hugepage_pool
from tandem.kv_transfer._peer_process import identity
from tandem.kv_transfer._socket_channel import request_id_of
from tandem.kv_transfer._ucx_frames import (
    message_pages,
    pages_to_read,
    send_chunk_record,
    send_frames,
)
from tandem.kv_transfer._ucx_incoming import WELCOME, UcxIncoming
from tandem.kv_transfer._ucx_lanes import (
    LANE_SCHEMES,
    discard,
    drain_unexpected,
    new_worker,
    tag_of,
    ucx_api,
)
from tandem.kv_transfer._ucx_records import _Conn, _Link, _Out
from tandem.kv_transfer._ucx_replies import AwaitedReplies
from tandem.kv_transfer.base import EncodedHeader, KVTransport, Message, drain_inbox
from tandem.kv_transfer.manifest import TransferError

logger = logging.getLogger(__name__)
SLOW_AFTER_S = 0.02  # idle this long, an endpoint pauses up to `slow_sleep_s` (see `_run`)
RUNG_SLEEP_S = 0.05  # how long a thread that peers ring sleeps at most (`_rung_only`)
UNHURRIED = frozenset({"ack", "renew"})  # ring no bell: a ring wakes a prefill's UCX thread,
# which takes the GIL from its engine (docs/benchmarks.md, session 50; and `_ucx_replies`)
GONE_CHECK_S = 0.2  # how often the senders on this machine are looked at (`_find_gone_senders`)


class UcxTransport(UcxIncoming, KVTransport):
    """KV transport over UCX; see the module docstring."""

    name = "ucx"

    def __init__(
        self,
        auth_token: str,
        *,
        send_timeout_s: float = 10.0,
        hello_timeout_s: float = 3.0,
        max_inflight: int = 32,
        idle_sleep_s: float = 0.001,
        slow_sleep_s: float | None = None,
        quiet_sleep_s: float = 0.02,
        ucx_config: dict[str, str] | None = None,
        split_min_bytes: int = 256 << 10,
        pull: bool = True,
    ) -> None:
        super().__init__(auth_token)
        self.send_timeout_s, self.hello_timeout_s = send_timeout_s, hello_timeout_s
        self.max_inflight = max(1, max_inflight)
        self.idle_sleep_s = max(0.0, idle_sleep_s)
        slow = 5 * self.idle_sleep_s if slow_sleep_s is None else slow_sleep_s
        self.slow_sleep_s = max(self.idle_sleep_s, slow)
        self._send_only = False  # set by `allocate_pool(send_only=True)`
        self.quiet_sleep_s = max(self.idle_sleep_s, quiet_sleep_s)
        self.split_min_bytes = split_min_bytes
        self._pull = pull and _cross_memory.can_read()  # (per peer: `_accept_pull`)
        lanes = LANE_SCHEMES if split_min_bytes > 0 else LANE_SCHEMES[:1]
        self._workers = [new_worker(scheme, ucx_config or {}) for scheme in lanes]
        self._worker = self._workers[0]  # every header frame; the pages' first share
        self._address = "ucx:" + ".".join(w.address.tobytes().hex() for w in self._workers)
        self._pool: KVCachePool | None = None
        self._pool_rows: np.ndarray | None = None  # the pool's blocks as rows of bytes (a view)
        self._lock = threading.Lock()  # every UCX call; all state but _commands and _inbox
        self._commands: deque[tuple[str, _Out]] = deque()  # appended to without the lock
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._links: dict[str, _Link] = {}
        self._retired: list[_Link] = []  # failed links kept until UCX has settled their sends
        self._conns: dict[int, _Conn] = {}
        self._next_gone_check = 0.0  # when `_find_gone_senders` looks next
        self._busy: list[tuple[Any, Any]] = []  # (request, what UCX uses until it completes)
        self._closed = False
        self._bell = Doorbell(self._address)  # `send` and `close` wake the thread; peers ring
        self._heard: set[bytes] = set()  # the bells of the peers whose rings reached ours
        self._replies = AwaitedReplies()  # last chunks whose ack the thread polls for
        self._thread = threading.Thread(target=self._run, name="ucx-transport", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    def allocate_pool(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        *,
        send_only: bool = False,
    ) -> KVCachePool:
        """A zero-filled CPU pool on transparent huge pages (UCX's shared-memory copies run about
        twice as fast over them); pass it as the engine's `kv_pool_factory`, then register it.
        Both ends of UCX want huge pages; `send_only` (a prefill worker's pool) lets the
        progress thread pause longer while nothing is in flight (`quiet_sleep_s`)."""
        self._send_only |= send_only
        return allocate_hugepage_pool(
            num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype
        )

    def register_pool(self, pool: KVCachePool) -> None:
        if pool.device.type != "cpu":
            raise TransferError("the ucx transport moves CPU pools only")
        if self._pull and self._links and self._pool is not None and pool is not self._pool:
            raise TransferError("the pool cannot change once links offered it to readers")
        self._pool = pool
        self._pool_rows = pool.tensor.view(torch.uint8).reshape(pool.num_blocks, -1).numpy()

    def send(self, peer: str, header: dict[str, Any], src_block_ids: Sequence[int] = ()) -> None:
        if self._closed:
            raise TransferError("transport is closed")
        ids = list(map(int, src_block_ids))
        if ids and not (min(ids) >= 0 and max(ids) < (self._pool.num_blocks if self._pool else 0)):
            raise TransferError(f"block ids {ids} are not in the registered pool")
        # A JSON copy (the caller may change its dict later), unless it comes encoded already.
        copy = header if isinstance(header, EncodedHeader) else json.loads(json.dumps(header))
        msg = _Out(copy, ids)
        if not self._send_now(peer, msg):
            self._commands.append((peer, msg))
            self._bell.wake()

    def _send_now(self, peer: str, msg: _Out) -> bool:
        """Sends the frame of `msg`, which has pages, on the caller's thread where its peer
        reads the pages itself and nothing is queued before it: the polling thread is not woken
        (it would take the GIL from a prefill engine for every chunk). Whether it did. (Others,
        a decode worker's acknowledgements among them, never wait for the thread's step.)"""
        if not msg.block_ids or self._commands or not self._lock.acquire(timeout=0.002):
            return False
        try:
            link = self._links.get(peer)
            if link is None or not link.pull or not link.welcomed or link.queue:
                return False
            if len(link.inflight) >= self.max_inflight:
                return False
            out = self._submit(link, msg)
            link.inflight.append(out)
            if not all(r.completed for r in out.requests):
                self._bell.wake()  # (a large frame: UCX's rendezvous needs the thread)
            return True
        except Exception:  # (the polling thread sends it, and reports what fails)
            return False
        finally:
            self._lock.release()

    def poll(self, timeout: float = 0.0) -> list[Message]:
        return drain_inbox(self._inbox, timeout)

    def cancel(self, request_id: str) -> int:
        dropped = 0
        with self._lock:
            self._take_commands()
            for link in self._links.values():
                kept = deque(m for m in link.queue if request_id_of(m.header) != request_id)
                dropped, link.queue = dropped + len(link.queue) - len(kept), kept
        return dropped

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bell.wake()
        self._thread.join(timeout=10.0)
        with self._lock:
            for _ in range(20):
                self._progress()
            for worker in self._workers:
                drain_unexpected(worker)
                worker.cancel_inflight_requests()
            # Endpoints go before the worker, and only now that no request is in flight.
            self._links, self._conns, self._busy, self._retired = {}, {}, [], []
        self._bell.close()

    def _progress(self) -> None:
        for worker in self._workers:
            worker.progress()

    def _run(self) -> None:
        # Polling progress (the module's "Speed"): pauses grow with the idle time (a quarter of
        # it, capped by `idle_sleep_s`, after `SLOW_AFTER_S` by `slow_sleep_s`), so a busy link
        # is served within tens of microseconds (each wake takes the GIL from a prefill engine).
        idle_since: float | None = None
        while not self._closed:
            quiet = rung = False
            try:
                with self._lock:
                    active = self._step()
                    if not active and not self._replies.pending(time.monotonic()):
                        rung = self._rung_only()  # (only an idle thread's pause needs these)
                        quiet = self._send_only and self._quiet()
            except Exception:  # keep the thread alive; the failure shows up as timeouts
                logger.exception("ucx transport: progress step failed")
                active = False
            if active:  # (UCX calls release the GIL: the owner's threads still get it)
                idle_since = None
                continue
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            idle = now - idle_since  # (quiet: nothing of ours to progress, so no ramp)
            cap = self.idle_sleep_s if idle < SLOW_AFTER_S else self.slow_sleep_s
            pause = self.quiet_sleep_s if quiet else min(cap, idle / 4)
            pause = max(pause, RUNG_SLEEP_S) if rung else pause
            if pause > 0 and not self._commands:
                self._heard = self._heard if len(self._heard) < 4096 else set()
                self._heard |= self._bell.wait(pause)  # (only this thread uses `_heard`)

    def _step(self) -> bool:  # one round of work; whether anything happened (then go on)
        active = self._take_commands()
        for peer, link in list(self._links.items()):
            active |= self._pump_link(peer, link)
        for worker in self._workers:
            for _ in range(1000):
                if not worker.progress_once():
                    break
                active = True
        for _ in range(64):  # header frames and welcomes (low 0 or 0x4000 | 1), in arrival order
            probe = self._worker.tag_probe(tag_of(0, 0), ucx_api.UCXXTagMask(0xBFFE), True)
            if not probe.matched:
                break
            active = True
            if probe.sender_tag.value & WELCOME:  # for one of our links
                discard(self._worker, probe, self._busy)
                for link in self._links.values():
                    if link.conn == probe.sender_tag.value >> 16:
                        link.welcomed = True
                        link.pull = link.offered and bool(probe.sender_tag.value & 1)
            else:
                self._on_header_frame(probe)
        for conn_id, conn in self._conns.items():
            active |= self._deliver(conn)
            if conn.state == "refused":
                active |= self._discard_pages(conn_id)
        self._busy = [(r, b) for r, b in self._busy if not r.completed]
        self._retired = [link for link in self._retired if not link.settled()]
        if time.monotonic() >= self._next_gone_check:
            self._next_gone_check = time.monotonic() + GONE_CHECK_S
            self._find_gone_senders()
        return active

    def _quiet(self) -> bool:
        """Nothing of this endpoint's is queued or in flight (under the lock)."""
        if self._commands or self._busy:
            return False
        return all(not link.queue and not link.inflight for link in self._links.values())

    def _take_commands(self) -> bool:
        taken = bool(self._commands)
        while self._commands:
            peer, msg = self._commands.popleft()
            try:
                (self._links.get(peer) or self._connect(peer)).queue.append(msg)
            except Exception as exc:  # UCX could not even create the endpoints
                self._report(peer, [request_id_of(msg.header)], f"cannot reach {peer[:40]}: {exc}")
        return taken

    def _connect(self, peer: str) -> _Link:
        lanes = [
            ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(a)) for a in peer[4:].split(".")
        ]
        new_endpoint = self._worker.create_endpoint_from_worker_address
        ep, watch = new_endpoint(lanes[0], False), new_endpoint(lanes[0], True)
        deadline = time.monotonic() + self.hello_timeout_s
        link = self._links[peer] = _Link(ep, watch, secrets.randbits(48) | 1, deadline)
        if len(lanes) > 1 and len(self._workers) > 1:  # pages of `split_min_bytes` are split
            link.ep_second = self._workers[1].create_endpoint_from_worker_address(lanes[1], False)
        link.bell = bell_name(peer)  # (rung after each frame; a peer elsewhere cannot be)
        hello = {"token": self.auth_token, "address": self.address, "process": identity()}
        if self._pull and self._pool is not None and self._pool.tensor.is_contiguous():
            hello["pull"] = _cross_memory.describe(self._pool)  # (see `_accept_pull`)
            link.offered = True
        link.inflight.append(self._send_frames(link, _Out({}, []), {"hello": hello}))
        self._bell.ring(link.bell)
        return link

    def _send_frames(self, link: _Link, out: _Out, body: dict[str, Any], pages: Any = None) -> _Out:
        return send_frames(link, out, body, pages, self.split_min_bytes, self.send_timeout_s)

    def _pump_link(self, peer: str, link: _Link) -> bool:
        active = False
        while link.inflight and all(r.completed for r in link.inflight[0].requests):
            with contextlib.suppress(Exception):
                for r in link.inflight[0].requests:
                    r.check_error()
                done, active = link.inflight.popleft(), True
                link.spare = link.spare if done.staging is None else done.staging
                continue
            return self._fail_link(peer, link, "send failed")
        if link.pull and any(not out.rung for out in link.inflight):  # (UCX is sending it:
            self._bell.ring(link.bell)  # the peer may have to act for it, so awake)
        late = time.monotonic() > (link.inflight[0].deadline if link.inflight else link.deadline)
        if not link.watch.alive or (late and (link.inflight or not link.welcomed)):
            why = "timed out" if link.welcomed else "no welcome (wrong cluster token?)"
            return self._fail_link(peer, link, why if link.watch.alive else "connection lost")
        while link.welcomed and link.queue and len(link.inflight) < self.max_inflight:
            link.inflight.append(self._submit(link, link.queue.popleft()))
            active = True
        return active

    def _submit(self, link: _Link, msg: _Out) -> _Out:
        seq, link.seq = link.seq, link.seq + 1
        if link.pull:  # the receiver reads the pages out of the pool
            if (sent := send_chunk_record(link, msg, self.send_timeout_s)) is not None:
                return self._rang(link, sent)
            pages, meta = None, pages_to_read(msg, self._pool)
        else:
            pages, meta = message_pages(link, msg, self._pool, self._pool_rows)
        body = {"seq": seq, "header": msg.header, "pages": meta}
        return self._rang(link, self._send_frames(link, msg, body, pages))

    def _rang(self, link: _Link, out: _Out) -> _Out:
        """Rings `link`'s peer for `out`, just handed to UCX (`_doorbell`), unless it is
        `UNHURRIED` or the peer never sleeps on its bell (only one whose senders all pull does);
        one that UCX has not sent yet is rung for again while it is in flight (`_pump_link`).
        A request's last chunk also wakes this thread, to poll for its ack (`_ucx_replies`)."""
        hurried = link.pull and out.header.get("type") not in UNHURRIED
        out.rung = not hurried or all(r.completed for r in out.requests)
        if hurried:
            self._bell.ring(link.bell)
        awaits = self._replies.sent(out.header, time.monotonic())
        if awaits and threading.get_ident() != self._thread.ident:  # (not the thread itself)
            self._bell.wake()
        return out

    def _fail_link(self, peer: str, link: _Link, error: str) -> bool:
        rids = [request_id_of(m.header) for m in [*link.inflight, *link.queue]]
        self._report(peer, list(dict.fromkeys(r for r in rids if r is not None)) or [None], error)
        # Endpoints close when dropped (ep.close() after a failure crashes), but not while a
        # send is in flight: its completion would drop the last reference inside UCX's progress,
        # and the endpoint's blocking close would progress the worker from there and hang
        # (a put_zcopy rendezvous completing after the send had timed out did that).
        self._retired.append(self._links.pop(peer))
        return True

    def _report(self, peer: str, request_ids: list[str | None], error: str) -> None:
        for rid in request_ids:
            header = {"type": "transport_error", "peer": peer, "request_id": rid, "error": error}
            self._inbox.put(Message(peer, header))
