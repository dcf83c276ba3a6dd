"""The receiving side of `UcxTransport` (`ucx.py`) that needs no UCX call of its own making:
whether a sender's pages are read out of its pool (`_accept_pull`), where a message's pages go
(`_post_pages`), handing finished messages on (`_deliver`), dropping what a refused peer sent
(`_discard_pages`) and noticing senders whose process ended (`_find_gone_senders`)."""

from __future__ import annotations

import logging
import queue
from typing import Any

import numpy as np

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _cross_memory
from tandem.kv_transfer._peer_process import process_ended
from tandem.kv_transfer._socket_channel import request_id_of
from tandem.kv_transfer._ucx_frames import _PAGES
from tandem.kv_transfer._ucx_lanes import Array, discard_matching, settle, tag_of, ucx_api
from tandem.kv_transfer._ucx_records import _Conn, _Rx
from tandem.kv_transfer.base import Message

logger = logging.getLogger("tandem.kv_transfer.ucx")
_ONE_CONN_PAGES = 0xFFFF_FFFF_FFFF_8000  # tag mask: a connection's page frames, any sequence


class UcxIncoming:
    """Mixed into `UcxTransport`, whose thread calls these under its lock."""

    _pull: bool
    _workers: list[Any]
    _conns: dict[int, _Conn]
    _busy: list[tuple[Any, Any]]
    _inbox: queue.Queue[Message]
    _pool: KVCachePool | None
    _pool_rows: np.ndarray | None

    def _report(self, peer: str, request_ids: list[str | None], error: str) -> None:
        raise NotImplementedError

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

    def _deliver(self, conn: _Conn) -> bool:  # completed messages, oldest first, to the inbox
        return conn.deliver(
            self._busy,
            lambda rx: self._inbox.put(Message(conn.peer, rx.header, rx.pages)),
            lambda rx, error: self._report(conn.peer, [request_id_of(rx.header)], error),
        )
