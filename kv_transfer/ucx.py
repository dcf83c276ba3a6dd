"""UCX transport (ucxx low-level API): worker-address endpoints, tag messages, own progress thread.

Wire: address `ucx:<hex of the worker address>`. Each link to a peer draws a random 48-bit id
`conn`; a tag is `conn << 16 | low`: 0 for a JSON header frame, `0x8000 | seq % 32768` for the
pages of header `seq`, `0x4000 | kind` for the peer's one-byte answer to the hello (1 welcome, 2
refused). A link sends `{"hello": {"token", "address"}}` and holds its messages until welcomed,
then sends `{"seq", "header", "pages": null | {"shape", "dtype", "direct", "dst_start"}}` frames,
each followed by its pages as one buffer (the pool slice when the src blocks are one run, else
a staging buffer they are gathered into).

Receiving: header frames are probed in arrival order. A connection whose hello lacks the cluster
token is refused: its frames are received into 1 byte (UCX truncates them) and no pages receive
is ever posted for it. Pages land in a new tensor of the announced shape, or in the pool
(`pages is None`, `header["direct"] is True`) when the sender set `header["direct"]`,
`manifest.dst_block_ids` is one run and shape and dtype match: before the protocol sees the
manifest, so only for dst blocks that stay reserved. `header["direct"]` is set whenever pages came.

Progress: one thread makes every UCX call (`send` only queues); it polls while events come and
sleeps in epoll on the worker's fd after `idle_spin_s` without any. Data endpoints skip UCX error
handling (which limits UCX to TCP, ~0.2 GB/s here, instead of shared memory and CMA); each link
also opens an idle endpoint with error handling whose TCP connection reports a dead peer at
once. A lost link, a refusal, or a message not sent (pages not received) within
`send_timeout_s` comes back from `poll()` as `transport_error` messages; the next `send`
reconnects. Up to `max_inflight` page messages per peer are handed to UCX; later ones stay
queued and cancellable.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import queue
import secrets
import select
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer.base import KVTransport, Message
from tandem.kv_transfer.manifest import TransferError

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables UCX 1.21 lacks
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

logger = logging.getLogger(__name__)
_PAGES, _WELCOME = 0x8000, 0x4000
_HELLO_MAX, _HEADER_MAX = 4096, 16 << 20


def _tag(conn: int, low: int) -> Any:
    return ucx_api.UCXXTag((conn << 16) | low)


def _request_id(header: dict[str, Any]) -> str | None:
    manifest = header.get("manifest")
    rid = header.get(
        "request_id", manifest.get("request_id") if isinstance(manifest, dict) else None
    )
    return None if rid is None else str(rid)


def _run_start(ids: Any) -> int | None:
    """The first id when `ids` is a non-empty consecutive ascending run of ints, else None."""
    if isinstance(ids, list) and ids and all(isinstance(b, int) for b in ids):
        return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
    return None


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass
class _Out:
    header: dict[str, Any]
    block_ids: list[int]
    requests: list[Any] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # buffers UCX reads until completion
    staging: torch.Tensor | None = None
    deadline: float = 0.0


@dataclass
class _Link:
    ep: Any
    watch: Any  # idle endpoint with UCX error handling: `alive` turns False when the peer dies
    conn: int
    deadline: float
    welcomed: bool = False
    queue: deque[_Out] = field(default_factory=deque)
    inflight: deque[_Out] = field(default_factory=deque)
    seq: int = 0


@dataclass
class _Rx:
    header: dict[str, Any]
    deadline: float = 0.0
    pages: torch.Tensor | None = None
    request: Any = None
    direct: bool = False
    failed: str | None = None


@dataclass
class _Conn:
    state: str = "hello"  # -> "ok" | "refused"
    peer: str = ""
    rx: deque[_Rx] = field(default_factory=deque)


class UcxTransport(KVTransport):
    """KV transport over UCX; see the module docstring for wire format, auth and progress."""

    name = "ucx"

    def __init__(
        self,
        auth_token: str,
        *,
        send_timeout_s: float = 10.0,
        hello_timeout_s: float = 3.0,
        max_inflight: int = 2,
        idle_spin_s: float = 0.0005,
        allow_direct: bool = True,
        staging_cache_bytes: int = 512 << 20,
    ) -> None:
        super().__init__(auth_token)
        self.send_timeout_s, self.hello_timeout_s = send_timeout_s, hello_timeout_s
        self.max_inflight = max(1, max_inflight)
        self.idle_spin_s, self.allow_direct = idle_spin_s, allow_direct
        self.staging_cache_bytes = staging_cache_bytes
        features = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        self._worker = ucx_api.UCXWorker(ucx_api.UCXContext(feature_flags=features))
        self._worker.init_blocking_progress_mode()
        self._address = "ucx:" + self._worker.address.tobytes().hex()
        self._pool: KVCachePool | None = None
        self._lock = threading.Lock()  # every UCX call; all state but _commands and _inbox
        self._commands: deque[tuple[str, _Out]] = deque()  # appended to without the lock
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._links: dict[str, _Link] = {}
        self._conns: dict[int, _Conn] = {}
        self._busy: list[tuple[Any, Any]] = []  # (request, what UCX uses until it completes)
        self._staging_free: list[torch.Tensor] = []
        self._closed = self._sleeping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._epoll = select.epoll()
        self._epoll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="ucx-transport", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    def register_pool(self, pool: KVCachePool) -> None:
        if pool.device.type != "cpu":
            raise TransferError("the ucx transport moves CPU pools only")
        self._pool = pool

    def send(self, peer: str, header: dict[str, Any], src_block_ids: Sequence[int] = ()) -> None:
        if self._closed:
            raise TransferError("transport is closed")
        if not peer.startswith("ucx:"):
            raise TransferError(f"not a ucx address: {peer[:40]!r}")
        ids = [int(b) for b in src_block_ids]
        num_blocks = -1 if self._pool is None else self._pool.num_blocks
        if ids and not all(0 <= b < num_blocks for b in ids):
            raise TransferError(f"block ids {ids} are not in the registered pool")
        header = json.loads(json.dumps(header))  # a JSON copy: fails here, not in the thread
        self._commands.append((peer, _Out(header, ids)))
        if self._sleeping:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def poll(self, timeout: float = 0.0) -> list[Message]:
        out: list[Message] = []
        with contextlib.suppress(queue.Empty):
            out.append(
                self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            )
            while True:
                out.append(self._inbox.get_nowait())
        return out

    def cancel(self, request_id: str) -> int:
        dropped = 0
        with self._lock:
            self._take_commands()
            for link in self._links.values():
                kept = deque(m for m in link.queue if _request_id(m.header) != request_id)
                dropped, link.queue = dropped + len(link.queue) - len(kept), kept
        return dropped

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=10.0)
        with self._lock:
            for link in self._links.values():
                self._close_link(link)
            for _ in range(20):
                self._worker.progress()
            self._worker.cancel_inflight_requests()
            self._worker.progress()
            self._links, self._conns, self._busy = {}, {}, []  # endpoints go before the worker
        self._epoll.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # ------------------------------------------------------------------ progress thread
    def _run(self) -> None:
        quiet_since = time.monotonic()
        while not self._closed:
            try:
                with self._lock:
                    active = self._step()
            except Exception:  # keep the thread alive; the failure shows up as timeouts
                logger.exception("ucx transport: progress step failed")
                active = False
            if active:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self.idle_spin_s:
                self._sleeping = True  # from here on `send` writes to the wake pipe
                with self._lock:
                    armed = not self._commands and not self._closed and self._worker.arm()
                if armed and self._epoll.poll(0.05):
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                self._sleeping = False

    def _step(self) -> bool:
        """Submits queued sends, progresses UCX, takes new frames, completes messages;
        returns whether anything happened (the thread keeps polling while things do)."""
        active = self._take_commands()
        for peer, link in list(self._links.items()):
            active |= self._pump_link(peer, link)
        for _ in range(1000):
            if not self._worker.progress_once():
                break
            active = True
        for low, mask in ((0, 0xFFFF), (_WELCOME, 0xFFFF)):
            for _ in range(64):
                probe = self._worker.tag_probe(
                    ucx_api.UCXXTag(low), ucx_api.UCXXTagMask(mask), True
                )
                if not probe.matched:
                    break
                active = True
                if low == 0:
                    self._on_header_frame(probe)
                else:
                    self._on_welcome(probe)
        for conn in self._conns.values():
            active |= self._deliver(conn)
        self._busy = [(r, b) for r, b in self._busy if not r.completed]
        return active

    # ------------------------------------------------------------------ sending
    def _take_commands(self) -> bool:
        taken = bool(self._commands)
        while self._commands:
            peer, msg = self._commands.popleft()
            try:
                (self._links.get(peer) or self._connect(peer)).queue.append(msg)
            except Exception as exc:  # UCX could not even create the endpoints
                self._report(peer, [_request_id(msg.header)], f"cannot reach {peer[:40]}: {exc}")
        return taken

    def _endpoint(self, peer: str, error_handling: bool = False) -> Any:
        addr = ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(peer[4:]))
        return self._worker.create_endpoint_from_worker_address(addr, error_handling)

    def _connect(self, peer: str) -> _Link:
        ep, watch = self._endpoint(peer), self._endpoint(peer, error_handling=True)
        deadline = time.monotonic() + self.hello_timeout_s
        link = self._links[peer] = _Link(ep, watch, secrets.randbits(48) | 1, deadline)
        hello = {"hello": {"token": self.auth_token, "address": self.address}}
        link.inflight.append(self._send_frames(link, _Out({}, []), hello))
        return link

    def _send_frames(self, link: _Link, out: _Out, body: dict[str, Any], pages: Any = None) -> _Out:
        out.deadline = time.monotonic() + self.send_timeout_s
        frames = [(np.frombuffer(bytearray(json.dumps(body).encode()), dtype=np.uint8), 0)]
        if pages is not None:
            frames.append((_bytes_of(pages), _PAGES | body["seq"] % _PAGES))
        for raw, low in frames:
            out.keep.append(raw)
            out.requests.append(link.ep.tag_send(Array(raw), _tag(link.conn, low)))
        return out

    def _pump_link(self, peer: str, link: _Link) -> bool:
        if not link.watch.alive:
            return self._fail_link(peer, link, "connection to the peer lost")
        active = False
        while link.inflight and all(r.completed for r in link.inflight[0].requests):
            try:
                for r in link.inflight[0].requests:
                    r.check_error()
            except Exception as exc:
                return self._fail_link(peer, link, f"send failed: {exc}")
            done, active = link.inflight.popleft(), True
            cached = sum(t.numel() for t in self._staging_free)
            if done.staging is not None and cached < self.staging_cache_bytes:
                self._staging_free.append(done.staging)
            done.keep, done.staging = [], None
        deadline = link.inflight[0].deadline if link.inflight else link.deadline
        if time.monotonic() > deadline and (link.inflight or not link.welcomed):
            why = "timed out" if link.welcomed else "no welcome (wrong cluster token?)"
            return self._fail_link(peer, link, f"{why}: peer gone, stuck or refusing")
        while (
            link.welcomed
            and link.queue
            and self.max_inflight > sum(1 for m in link.inflight if m.block_ids)
        ):
            link.inflight.append(self._submit(link, link.queue.popleft()))
            active = True
        return active

    def _submit(self, link: _Link, msg: _Out) -> _Out:
        seq, link.seq = link.seq, link.seq + 1
        pages, meta, pool, n = None, None, self._pool, len(msg.block_ids)
        if n and pool is not None:
            if (start := _run_start(msg.block_ids)) is not None:
                pages = pool.tensor[start : start + n]
            else:  # gather into the smallest cached staging buffer that fits
                nbytes, free = n * pool.bytes_per_block, self._staging_free
                fits = sorted((t for t in free if t.numel() >= nbytes), key=torch.numel)
                msg.staging = fits[0] if fits else torch.empty(nbytes, dtype=torch.uint8)
                self._staging_free = [t for t in free if t is not msg.staging]
                pages = msg.staging[:nbytes].view(pool.dtype).view(pool.blocks_shape(n))
                torch.index_select(pool.tensor, 0, torch.tensor(msg.block_ids), out=pages)
            manifest = msg.header.get("manifest")
            dst = manifest.get("dst_block_ids") if isinstance(manifest, dict) else None
            meta = {
                "shape": list(pool.blocks_shape(n)),
                "dtype": str(pool.dtype).removeprefix("torch."),
                "direct": bool(msg.header.get("direct")),
                "dst_start": _run_start(dst) if isinstance(dst, list) and len(dst) == n else None,
            }
        return self._send_frames(
            link, msg, {"seq": seq, "header": msg.header, "pages": meta}, pages
        )

    def _on_welcome(self, probe: Any) -> None:
        self._discard(probe)
        for link in self._links.values():
            link.welcomed |= link.conn == probe.sender_tag.value >> 16

    def _fail_link(self, peer: str, link: _Link, error: str) -> bool:
        logger.info("ucx transport: link to %s… failed: %s", peer[:24], error)
        rids = [_request_id(m.header) for m in [*link.inflight, *link.queue]]
        self._report(peer, list(dict.fromkeys(r for r in rids if r is not None)) or [None], error)
        self._close_link(self._links.pop(peer))
        return True

    def _report(self, peer: str, request_ids: list[str | None], error: str) -> None:
        for rid in request_ids:
            header = {"type": "transport_error", "peer": peer, "request_id": rid, "error": error}
            self._inbox.put(Message(peer, header))

    @staticmethod
    def _close_link(link: _Link) -> None:
        for ep in (link.ep, link.watch):
            with contextlib.suppress(Exception):
                if ep.alive:  # closing an endpoint UCX already failed crashes ucxx 0.52
                    ep.close()

    # ------------------------------------------------------------------ receiving
    def _on_header_frame(self, probe: Any) -> None:
        conn_id = probe.sender_tag.value >> 16
        conn = self._conns.setdefault(conn_id, _Conn())
        body = None
        if conn.state != "refused" and probe.length <= (_HEADER_MAX if conn.peer else _HELLO_MAX):
            body = self._read_frame(probe)
        else:
            self._discard(probe)
        if conn.state == "hello":
            hello = body.get("hello") if body else None
            hello = hello if isinstance(hello, dict) else {}
            token, peer = str(hello.get("token")).encode(), str(hello.get("address"))
            good = hmac.compare_digest(token, self.auth_token.encode()) and peer[:4] == "ucx:"
            conn.state, conn.peer = ("ok", peer) if good else ("refused", "")
            if not good:
                return logger.warning("ucx transport: refused connection %x (bad hello)", conn_id)
            try:  # welcome it over our own link to it (never an unauthenticated peer: our
                link = self._links.get(peer) or self._connect(peer)  # hello has the token)
                buf = np.zeros(1, dtype=np.uint8)
                self._busy.append((link.ep.tag_send(Array(buf), _tag(conn_id, _WELCOME)), buf))
            except Exception:
                logger.warning("ucx transport: cannot answer %s…", peer[:24], exc_info=True)
        elif conn.state == "ok" and isinstance(body, dict) and isinstance(body.get("header"), dict):
            rx = _Rx(body["header"], time.monotonic() + self.send_timeout_s)
            conn.rx.append(rx)
            try:
                if body.get("pages") is not None:
                    self._post_pages(conn_id, rx, body["pages"], int(body["seq"]))
            except Exception as exc:
                rx.failed = f"refused pages: {exc}"
        elif conn.state == "ok":
            conn.rx.append(_Rx({}, failed=f"unreadable header frame ({probe.length} bytes)"))

    def _read_frame(self, probe: Any) -> dict[str, Any] | None:
        """Receives a probed header frame (over 8 KiB, UCX's rendezvous threshold, it takes a
        round trip) and parses it as a JSON object; None if that fails."""
        buf = np.empty(probe.length, dtype=np.uint8)
        request = self._worker.tag_recv_with_handle(Array(buf), probe)
        deadline = time.monotonic() + min(1.0, self.send_timeout_s)
        while not request.completed and time.monotonic() < deadline:
            self._worker.progress()
        try:
            request.check_error()
            body = json.loads(buf.tobytes())
        except Exception:
            logger.debug("ucx transport: unreadable frame", exc_info=True)
            return None
        return body if isinstance(body, dict) else None

    def _discard(self, probe: Any) -> None:
        """Receives a probed frame into one byte: UCX truncates anything longer."""
        buffer = np.zeros(1, dtype=np.uint8)
        self._busy.append((self._worker.tag_recv_with_handle(Array(buffer), probe), buffer))

    def _post_pages(self, conn_id: int, rx: _Rx, meta: dict[str, Any], seq: int) -> None:
        shape, dtype = [int(d) for d in meta["shape"]], getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype) or len(shape) != 6 or min(shape) <= 0:
            raise ValueError(f"pages {meta['dtype']} {shape}")
        pool, start = self._pool, meta.get("dst_start")
        rx.direct = bool(
            meta.get("direct")
            and self.allow_direct
            and pool is not None
            and isinstance(start, int)
            and tuple(shape[1:]) == pool.block_shape
            and dtype == pool.dtype
            and 0 <= start <= pool.num_blocks - shape[0]
        )
        if rx.direct and pool is not None and isinstance(start, int):
            target = pool.tensor[start : start + shape[0]]
        else:  # raises for absurd sizes: only authenticated peers get here
            target = rx.pages = torch.empty(shape, dtype=dtype)
        tag = _tag(conn_id, _PAGES | seq % _PAGES)
        rx.request = self._worker.tag_recv(Array(_bytes_of(target)), tag, ucx_api.UCXXTagMaskFull)

    def _deliver(self, conn: _Conn) -> bool:
        """Moves a connection's completed messages, oldest first, to the inbox."""
        delivered = False
        while conn.rx:
            rx = conn.rx[0]
            if rx.failed is None and rx.request is not None:
                if not rx.request.completed:
                    if time.monotonic() <= rx.deadline:
                        break
                    self._busy.append((rx.request, rx.pages))  # UCX still owns the buffer
                    rx.failed = "pages receive timed out (sender gone?)"
                else:
                    try:
                        rx.request.check_error()
                    except Exception as exc:
                        rx.failed = f"pages receive failed: {exc}"
            conn.rx.popleft()
            delivered = True
            if rx.failed is not None:
                self._report(conn.peer, [_request_id(rx.header)], rx.failed)
                continue
            if rx.request is not None:
                rx.header["direct"] = rx.direct
            self._inbox.put(Message(conn.peer, rx.header, rx.pages))
        return delivered
