"""UCX transport (ucxx low-level API): worker-address endpoints, tag messages, own polling thread.

Address `ucx:<hex worker address>[.<hex worker address>]`: lane 0, and lane 1 where there is one
(a second UCX worker, progressed by the same thread, whose rendezvous has the receiver read).
A link to a peer draws a random 48-bit `conn`; tags are `conn << 16 | low`: `low` 0 for JSON
header frames, `0x8000 | seq % 32768` for the pages of header `seq` (the pool slice for one run
of src blocks, else a gather), 0x4000 for a welcome. Pages of `split_min_bytes` or more go in
two shares, the first on lane 0 (the sender's thread copies it into the receiver) and the
second on lane 1 (the receiver's thread copies it out of the sender) at the same time. A link
sends `{"hello": {"token", "address"}}`; once the peer welcomes it (over its own link to us) its
`{"seq", "header", "pages": null | {"shape", "dtype", "direct", "dst_start"}}` frames follow.
Without the token no welcome comes, frames are received into 1 byte (UCX truncates them), and
no pages receive is posted. Pages land in the pool (`pages is None`, `header["direct"]` True)
when the header's `manifest.dst_block_ids` are one run and shape and dtype match, as with the shm
and torch transports (a sender opts out with `header["direct"] = False`), else in a new tensor
(`header["direct"]` False). That happens before the protocol sees the manifest: the receiver
holds blocks of ended reservations until the sender confirms it stopped (`receiver.py`).

Speed (see docs/benchmarks.md): one thread per transport makes every UCX call (`send` only queues)
and *polls*: it steps without pausing while there is work and pauses for at most `idle_sleep_s`
when idle (UCX's WAKEUP feature, needed to sleep on the worker's fd, halves its shared-memory
throughput); an endpoint with a send-only pool (a prefill worker's) pauses for up to
`quiet_sleep_s` while nothing of its own is queued or in flight, since only acknowledgements can
arrive then (each wake-up takes the GIL from the engine: 1,000 a second cost a 1.7 s CPU prefill
~2.5 ms). `allocate_pool` gives pools on transparent huge pages (UCX's CMA copies pin pages one at
a time). Data endpoints skip UCX error handling (it limits UCX to TCP); an idle second endpoint
with it reports a dead peer at once. Lost links, no welcome in `hello_timeout_s`, sends or page
receives not done in `send_timeout_s` come back from `poll()` as `transport_error`s; a sender
on this machine whose process ended is reported ``peer_gone`` within `GONE_CHECK_S`. At most
`max_inflight` messages per peer (32: more overlapped rendezvous; 8 moved 16 MiB chunks ~25 %
slower here) are handed to UCX at once. `ucx_config` adds UCX options.
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
from tandem.kv_transfer._hugepages import allocate_hugepage_pool
from tandem.kv_transfer._peer_process import identity, process_ended
from tandem.kv_transfer._socket_channel import request_id_of
from tandem.kv_transfer._ucx_frames import _PAGES, message_pages, send_frames
from tandem.kv_transfer._ucx_lanes import (
    LANE_SCHEMES,
    Array,
    discard,
    discard_matching,
    drain_unexpected,
    new_worker,
    receive_json,
    settle,
    tag_of,
    ucx_api,
)
from tandem.kv_transfer._ucx_records import _Conn, _Link, _Out, _Rx, hello_peer
from tandem.kv_transfer.base import EncodedHeader, KVTransport, Message, drain_inbox
from tandem.kv_transfer.manifest import TransferError

logger = logging.getLogger(__name__)
_WELCOME, _HELLO_MAX, _HEADER_MAX = 0x4000, 4096, 16 << 20
_ONE_CONN_PAGES = 0xFFFF_FFFF_FFFF_8000  # tag mask: a connection's page frames, any sequence
GONE_CHECK_S = 0.2  # how often the senders on this machine are looked at (`_find_gone_senders`)


class UcxTransport(KVTransport):
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
        quiet_sleep_s: float = 0.02,
        ucx_config: dict[str, str] | None = None,
        split_min_bytes: int = 256 << 10,
    ) -> None:
        super().__init__(auth_token)
        self.send_timeout_s, self.hello_timeout_s = send_timeout_s, hello_timeout_s
        self.max_inflight = max(1, max_inflight)
        self.idle_sleep_s = max(0.0, idle_sleep_s)
        self.quiet_sleep_s = max(self.idle_sleep_s, quiet_sleep_s)
        self._send_only = False  # set by `allocate_pool(send_only=True)`
        self.split_min_bytes = split_min_bytes
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
        self._wake = threading.Event()  # set by `send` and `close`: cuts an idle pause short
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
        self._commands.append((peer, _Out(copy, ids)))
        self._wake.set()

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
        self._wake.set()
        self._thread.join(timeout=10.0)
        with self._lock:
            for _ in range(20):
                self._progress()
            for worker in self._workers:
                drain_unexpected(worker)
                worker.cancel_inflight_requests()
            # Endpoints go before the worker, and only now that no request is in flight.
            self._links, self._conns, self._busy, self._retired = {}, {}, [], []

    def _progress(self) -> None:
        for worker in self._workers:
            worker.progress()

    def _run(self) -> None:
        # Polling progress: after any activity the thread keeps stepping with short pauses that
        # grow with the idle time (a quarter of it, capped by `idle_sleep_s`), so a busy link
        # is served within tens of microseconds and an idle endpoint wakes about 1000 times/s.
        idle_since: float | None = None
        while not self._closed:
            quiet = False
            try:
                with self._lock:
                    active = self._step()
                    quiet = self._send_only and self._quiet()
            except Exception:  # keep the thread alive; the failure shows up as timeouts
                logger.exception("ucx transport: progress step failed")
                active = False
            if active:  # (UCX calls release the GIL: the owner's threads still get it)
                idle_since = None
                continue
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            cap = self.quiet_sleep_s if quiet else self.idle_sleep_s
            pause = min(cap, (now - idle_since) / 4)
            if pause > 0 and not self._commands:
                self._wake.wait(pause)
                self._wake.clear()

    def _step(self) -> bool:  # one round of work; whether anything happened (then go on)
        active = self._take_commands()
        for peer, link in list(self._links.items()):
            active |= self._pump_link(peer, link)
        for worker in self._workers:
            for _ in range(1000):
                if not worker.progress_once():
                    break
                active = True
        for _ in range(64):  # header frames and welcomes (low 0 or 0x4000), in arrival order
            probe = self._worker.tag_probe(tag_of(0, 0), ucx_api.UCXXTagMask(0xBFFF), True)
            if not probe.matched:
                break
            active = True
            if probe.sender_tag.value & _WELCOME:  # for one of our links
                discard(self._worker, probe, self._busy)
                for link in self._links.values():
                    link.welcomed |= link.conn == probe.sender_tag.value >> 16
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

    def _find_gone_senders(self) -> None:
        """Senders on this machine whose process ended: once UCX has handed on what they had
        sent (its queues drained), their unfinished messages are dropped and a ``peer_gone``
        message follows (see `tandem.kv_transfer.base`)."""
        gone = {i: c for i, c in self._conns.items() if c.pid and process_ended(c.pid)}
        if not gone:
            return
        settle(self._workers)  # (what a dead sender wrote into shared memory lands now)
        for conn_id, conn in gone.items():
            self._deliver(conn)
            conn.abandon(self._busy)
            del self._conns[conn_id]
        for peer in {c.peer for c in gone.values()}:
            logger.info("ucx transport: %s is gone (its process ended)", peer[:40])
            self._inbox.put(Message(peer, {"type": "peer_gone"}))

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
        hello = {
            "hello": {"token": self.auth_token, "address": self.address, "process": identity()}
        }
        link.inflight.append(self._send_frames(link, _Out({}, []), hello))
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
        pages, meta = message_pages(link, msg, self._pool, self._pool_rows)
        return self._send_frames(
            link, msg, {"seq": seq, "header": msg.header, "pages": meta}, pages
        )

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

    def _on_header_frame(self, probe: Any) -> None:
        conn_id = probe.sender_tag.value >> 16
        conn = self._conns.setdefault(conn_id, _Conn())
        body: dict[str, Any] | None = None
        if conn.state != "refused" and probe.length <= (_HEADER_MAX if conn.peer else _HELLO_MAX):
            body = receive_json(self._worker, probe, min(1.0, self.send_timeout_s))
        else:
            discard(self._worker, probe, self._busy)
        if conn.state == "hello":
            peer, conn.pid = hello_peer(body, self.auth_token) or ("", None)
            conn.state, conn.peer = ("ok", peer) if peer else ("refused", "")
            if not peer:
                return logger.warning("ucx transport: refused connection %x (bad hello)", conn_id)
            link = self._links.get(peer) or self._connect(peer)  # (our hello has the token:
            buf = np.zeros(1, dtype=np.uint8)  # never for an unauthenticated peer)
            self._busy.append((link.ep.tag_send(Array(buf), tag_of(conn_id, _WELCOME)), buf))
        elif conn.state == "ok":
            rx = _Rx({}, time.monotonic() + self.send_timeout_s)
            conn.rx.append(rx)
            try:
                if not body or not isinstance(body.get("header"), dict):
                    raise ValueError(f"unreadable header frame ({probe.length} bytes)")
                rx.header = body["header"]
                if body.get("pages") is not None:
                    self._post_pages(conn_id, rx, body["pages"], int(body["seq"]))
            except Exception as exc:
                rx.failed = f"refused message: {exc}"

    def _discard_pages(self, conn_id: int) -> bool:
        """Takes the page frames a refused peer sent anyway (a sender that did not wait for
        the welcome) off every lane, so that none stays in UCX's unexpected queue holding
        memory until the transport closes. Whether any was found."""
        tag, mask = tag_of(conn_id, _PAGES), ucx_api.UCXXTagMask(_ONE_CONN_PAGES)
        return any([discard_matching(w, tag, mask, self._busy) for w in self._workers])

    def _post_pages(self, conn_id: int, rx: _Rx, meta: dict[str, Any], seq: int) -> None:
        raw, cut = rx.buffer(self._pool, self._pool_rows, meta), meta.get("split")
        shares = [raw]
        if cut is not None:  # the second share comes on lane 1
            if not (len(self._workers) > 1 and isinstance(cut, int) and 0 < cut < raw.nbytes):
                raise ValueError(f"pages split at {cut!r} of {raw.nbytes} bytes")
            shares = [raw[:cut], raw[cut:]]
        tag = tag_of(conn_id, _PAGES | seq % _PAGES)
        for worker, share in zip(self._workers, shares, strict=False):
            rx.requests.append(worker.tag_recv(Array(share), tag, ucx_api.UCXXTagMaskFull))

    def _deliver(self, conn: _Conn) -> bool:  # completed messages, oldest first, to the inbox
        return conn.deliver(
            self._busy,
            lambda rx: self._inbox.put(Message(conn.peer, rx.header, rx.pages)),
            lambda rx, error: self._report(conn.peer, [request_id_of(rx.header)], error),
        )
