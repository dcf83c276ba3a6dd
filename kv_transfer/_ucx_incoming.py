"""The receiving side of `UcxTransport` (`ucx.py`): a header frame taken off lane 0
(`_on_header_frame`: a hello, answered with a welcome, or a message's header, JSON or a compact
record, `_chunk_message`, `_on_layout`), whether the thread may sleep on its doorbell
(`_rung_only`), whether a sender's pages are read out of its pool (`_accept_pull`), where a
message's pages go (`_post_pages`), handing finished messages on (`_deliver`, which also ends
the wait for an ack: `_ucx_replies`), dropping what a refused peer sent (`_discard_pages`) and
noticing senders whose process ended (`_find_gone_senders`)."""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

import numpy as np

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _cross_memory
from tandem.kv_transfer._chunk_records import (
    CHUNK,
    LAYOUT,
    MAX_LAYOUTS,
    parse_chunk,
    parse_layout,
)
from tandem.kv_transfer._doorbell import Doorbell, bell_name
from tandem.kv_transfer._peer_process import process_ended
from tandem.kv_transfer._socket_channel import request_id_of
from tandem.kv_transfer._ucx_frames import _PAGES, block_runs, pages_meta
from tandem.kv_transfer._ucx_lanes import (
    Array,
    discard,
    discard_matching,
    json_object,
    receive_frame,
    settle,
    tag_of,
    ucx_api,
)
from tandem.kv_transfer._ucx_records import _Conn, _Link, _Rx, hello_peer
from tandem.kv_transfer._ucx_replies import AwaitedReplies
from tandem.kv_transfer.base import Message

logger = logging.getLogger("tandem.kv_transfer.ucx")
_ONE_CONN_PAGES = 0xFFFF_FFFF_FFFF_8000  # tag mask: a connection's page frames, any sequence
WELCOME, _HELLO_MAX, _HEADER_MAX = 0x4000, 4096, 16 << 20  # a welcome's low tag bits; sizes


class UcxIncoming:
    """Mixed into `UcxTransport`, whose thread calls these under its lock."""

    auth_token: str
    _pull: bool
    _worker: Any
    _workers: list[Any]
    _links: dict[str, _Link]
    _conns: dict[int, _Conn]
    _busy: list[tuple[Any, Any]]
    _inbox: queue.Queue[Message]
    _pool: KVCachePool | None
    _pool_rows: np.ndarray | None
    send_timeout_s: float
    _bell: Doorbell
    _heard: set[bytes]
    _replies: AwaitedReplies

    def _report(self, peer: str, request_ids: list[str | None], error: str) -> None:
        raise NotImplementedError

    def _connect(self, peer: str) -> _Link:
        raise NotImplementedError

    def _quiet(self) -> bool:
        raise NotImplementedError

    def _rung_only(self) -> bool:
        """The thread may sleep on its bell (under the lock): every sender it hears from has
        rung it (and its pages are read here), it is receiving nothing, and nothing of its own
        is under way."""
        if not (self._bell.bound and self._conns and self._quiet()):
            return False
        heard, links = self._heard, self._links.values()
        rung = all(c.remote and c.bell in heard and not c.rx for c in self._conns.values())
        return rung and all(link.welcomed for link in links)

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

    def _accept_pull(self, conn: _Conn, body: Any, peer: str) -> int:
        """1 if this endpoint will read the pages of `conn`'s sender out of the pool its hello
        offers (the sender runs on this machine, the kernel lets us read its memory), else 0
        (the sender sends them). See the module docstring for why not through UCX."""
        offer = body["hello"].get("pull")
        if not (self._pull and conn.pid is not None and isinstance(offer, dict)):
            return 0
        try:
            conn.remote = _cross_memory.pool_in_process(offer, conn.pid)
        except Exception as exc:
            logger.info("ucx transport: bad pool offer from %s: %s", peer[:40], exc)
        return 0 if conn.remote is None else 1

    def _on_header_frame(self, probe: Any) -> None:
        conn_id = probe.sender_tag.value >> 16
        conn = self._conns.setdefault(conn_id, _Conn())
        raw: bytes | None = None
        if conn.state != "refused" and probe.length <= (_HEADER_MAX if conn.peer else _HELLO_MAX):
            raw = receive_frame(self._worker, probe, min(1.0, self.send_timeout_s))
        else:
            discard(self._worker, probe, self._busy)
        if conn.state == "ok" and raw and raw[0] == LAYOUT:  # (compact: `_ucx_frames`)
            return self._on_layout(conn, raw)
        body = json_object(raw) if not (raw and raw[0] == CHUNK) else None
        if conn.state == "hello":
            peer, conn.pid = hello_peer(body, self.auth_token) or ("", None)
            conn.state, conn.peer = ("ok", peer) if peer else ("refused", "")
            if not peer:
                return logger.warning("ucx transport: refused connection %x (bad hello)", conn_id)
            link = self._links.get(peer) or self._connect(peer)  # (our hello has the token:
            buf = np.zeros(1, dtype=np.uint8)  # never for an unauthenticated peer)
            welcome = WELCOME | self._accept_pull(conn, body, peer)
            conn.bell = bell_name(peer)  # (its rings come from there: `UcxTransport._rung_only`)
            self._busy.append((link.ep.tag_send(Array(buf), tag_of(conn_id, welcome)), buf))
        elif conn.state == "ok":
            rx = _Rx({}, time.monotonic() + self.send_timeout_s)
            conn.rx.append(rx)
            try:
                if raw and raw[0] == CHUNK:  # a plain chunk's compact record
                    rx.header, meta = self._chunk_message(conn, raw)
                    self._post_pages(conn_id, rx, meta, 0)
                elif not body or not isinstance(body.get("header"), dict):
                    raise ValueError(f"unreadable header frame ({probe.length} bytes)")
                else:
                    rx.header = body["header"]
                    if body.get("pages") is not None:
                        self._post_pages(conn_id, rx, body["pages"], int(body["seq"]))
            except Exception as exc:
                rx.failed = f"refused message: {exc}"

    def _on_layout(self, conn: _Conn, raw: bytes) -> None:
        """A layout record (`_chunk_records`): noted for the chunk records that name it."""
        if conn.remote is None or len(conn.layouts) >= MAX_LAYOUTS:  # (a sender announces at
            return logger.warning(  # most MAX_LAYOUTS, then sends JSON; only a pull link any)
                "ucx transport: layout record from %s refused", conn.peer[:40]
            )
        try:
            conn.layouts.append(parse_layout(raw))
        except ValueError as exc:  # (its chunks then fail: the receiver refuses {})
            logger.warning("ucx transport: bad layout record from %s: %s", conn.peer[:40], exc)
            conn.layouts.append({})  # (keeps the indices of the layouts after it)

    def _chunk_message(self, conn: _Conn, raw: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
        """The header a chunk record stands for (as its JSON frame would have said it) and its
        pages' description, to be read out of the sender's pool."""
        if conn.remote is None:
            raise ValueError("a compact record from a sender whose pages are not read here")
        header, src = parse_chunk(raw, conn.layouts)
        dst, remote = header["manifest"]["dst_block_ids"], conn.remote
        meta = pages_meta(len(src), remote.block_shape, remote.dtype, True, dst)
        return header, {**meta, "runs": block_runs(src)}

    def _discard_pages(self, conn_id: int) -> bool:
        """Takes the page frames a refused peer sent anyway (a sender that did not wait for
        the welcome) off every lane, so that none stays in UCX's unexpected queue holding
        memory until the transport closes. Whether any was found."""
        tag, mask = tag_of(conn_id, _PAGES), ucx_api.UCXXTagMask(_ONE_CONN_PAGES)
        return any([discard_matching(w, tag, mask, self._busy) for w in self._workers])

    def _post_pages(self, conn_id: int, rx: _Rx, meta: dict[str, Any], seq: int) -> None:
        raw, cut = rx.buffer(self._pool, self._pool_rows, meta), meta.get("split")
        if "runs" in meta:  # to read out of the sender's pool (`_accept_pull`)
            remote = self._conns[conn_id].remote
            if remote is None:
                raise ValueError("pages to read from a sender whose pool is not read here")
            remote.read_runs(meta["runs"], raw)  # (a system call: the GIL is dropped meanwhile)
            return
        shares = [raw]
        if cut is not None:  # the second share comes on lane 1
            if not (len(self._workers) > 1 and isinstance(cut, int) and 0 < cut < raw.nbytes):
                raise ValueError(f"pages split at {cut!r} of {raw.nbytes} bytes")
            shares = [raw[:cut], raw[cut:]]
        tag = tag_of(conn_id, _PAGES | seq % _PAGES)
        for worker, share in zip(self._workers, shares, strict=False):
            rx.requests.append(worker.tag_recv(Array(share), tag, ucx_api.UCXXTagMaskFull))

    def _take(self, conn: _Conn, rx: _Rx) -> None:
        self._replies.answered(rx.header)
        self._inbox.put(Message(conn.peer, rx.header, rx.pages))

    def _deliver(self, conn: _Conn) -> bool:  # completed messages, oldest first, to the inbox
        return conn.deliver(
            self._busy,
            lambda rx: self._take(conn, rx),
            lambda rx, error: self._report(conn.peer, [request_id_of(rx.header)], error),
        )
