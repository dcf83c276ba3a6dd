"""What the UCX transport keeps per message, link and incoming connection (see `ucx.py`)."""

from __future__ import annotations

import hmac
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer._cross_memory import RemotePool
from tandem.kv_transfer._peer_process import claimed_pid


def hello_peer(body: dict[str, Any] | None, auth_token: str) -> tuple[str, int | None] | None:
    """The address a connection's hello frame names and the sender's pid where it runs on
    this machine (`_peer_process.claimed_pid`), if it carries the cluster token and a UCX
    address; else None (the connection is refused)."""
    hello = body["hello"] if body and isinstance(body.get("hello"), dict) else {}
    token, peer = str(hello.get("token")).encode(), str(hello.get("address"))
    good = hmac.compare_digest(token, auth_token.encode()) and peer[:4] == "ucx:"
    return (peer, claimed_pid(hello)) if good else None


def _run_start(ids: Any) -> int | None:  # the first id of a list that is one run of ints
    if isinstance(ids, list) and ids and all(isinstance(b, int) for b in ids):
        return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
    return None


@dataclass
class _Out:
    header: dict[str, Any]
    block_ids: list[int]
    requests: list[Any] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # buffers UCX reads until completion
    staging: torch.Tensor | None = None
    deadline: float = 0.0
    rung: bool = False  # no ring is owed for it (`UcxTransport._rang`)


@dataclass
class _Link:
    ep: Any
    watch: Any  # idle endpoint with UCX error handling: `alive` turns False when the peer dies
    conn: int
    deadline: float  # for the welcome
    welcomed: bool = False
    queue: deque[_Out] = field(default_factory=deque)
    inflight: deque[_Out] = field(default_factory=deque)
    seq: int = 0
    spare: torch.Tensor | None = None  # a staging buffer to reuse
    ep_second: Any = None  # to the peer's lane 1, where it has one (pages' second shares)
    offered: bool = False  # our hello offered our pool to be read
    pull: bool = False  # the peer reads pages out of our pool (its welcome said so)
    layouts: dict[str, int] = field(default_factory=dict)  # sent in compact records, by index
    compact: bool = True  # plain chunks may go as compact records (`send_chunk_record`)
    bell: bytes = b""  # the peer's doorbell (`_doorbell.bell_name`)

    def settled(self) -> bool:
        """No send of this link's is still in UCX's hands."""
        return all(r.completed for out in self.inflight for r in out.requests)


@dataclass
class _Rx:
    header: dict[str, Any]
    deadline: float = 0.0
    pages: torch.Tensor | None = None
    requests: list[Any] = field(default_factory=list)  # the pages' receives (one per share)
    direct: bool = False
    failed: str | None = None

    def buffer(self, pool: KVCachePool | None, pool_rows: Any, meta: dict[str, Any]) -> Any:
        """Where the pages `meta` announces land, as raw bytes: the pool's blocks from
        `dst_start` when the header allows it and shape and dtype fit (`direct`), else a new
        tensor (`pages`). Raises ValueError for a bad shape or dtype."""
        shape, dtype = [int(d) for d in meta["shape"]], getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype) or len(shape) != 6 or min(shape) <= 0:
            raise ValueError(f"pages {meta['dtype']} {shape}")
        start = meta.get("dst_start")
        if pool is not None and isinstance(start, int) and meta.get("direct"):
            fits = (tuple(shape[1:]), dtype) == (pool.block_shape, pool.dtype)
            self.direct = fits and 0 <= start <= pool.num_blocks - shape[0]
        if self.direct and pool_rows is not None and isinstance(start, int):
            return pool_rows[start : start + shape[0]].reshape(-1)  # numpy: no torch calls
        # (raises for absurd sizes: only authenticated peers get here)
        self.pages = torch.empty(shape, dtype=dtype)
        raw: np.ndarray = self.pages.reshape(-1).view(torch.uint8).numpy()
        return raw


@dataclass
class _Conn:
    state: str = "hello"  # -> "ok" | "refused"
    peer: str = ""
    rx: deque[_Rx] = field(default_factory=deque)
    pid: int | None = None  # the sender's, where it runs on this machine
    remote: RemotePool | None = None  # the sender's pool, where pages are read out of it
    layouts: list[dict[str, Any]] = field(default_factory=list)  # announced by layout records
    bell: bytes = b""  # the sender's doorbell, whence its rings come (`_doorbell`)

    def abandon(self, busy: list[tuple[Any, Any]]) -> None:
        """Drops the messages whose pages never came (their sender is gone); the receives UCX
        still owns go to `busy`."""
        for rx in self.rx:
            busy.extend((r, rx.pages) for r in rx.requests if not r.completed)
        self.rx.clear()

    def deliver(
        self,
        busy: list[tuple[Any, Any]],
        done: Callable[[_Rx], None],
        failed: Callable[[_Rx, str], None],
    ) -> bool:
        """Hands on the messages whose pages arrived, oldest first (`done`), and those that
        failed or timed out (`failed`); a timed-out receive's buffer goes to `busy` (UCX still
        owns it). Whether any message was handed on."""
        count = len(self.rx)
        while self.rx:
            rx = self.rx[0]
            pending = [r for r in rx.requests if not r.completed]
            if rx.failed is None and pending:
                if time.monotonic() <= rx.deadline:
                    break
                busy.extend((r, rx.pages) for r in pending)
                rx.failed = "pages receive timed out (sender gone?)"
            elif rx.failed is None:
                try:
                    for request in rx.requests:
                        request.check_error()
                    rx.header["direct"] = rx.direct
                except Exception as exc:
                    rx.failed = f"pages receive failed: {exc}"
            self.rx.popleft()
            if rx.failed is None:
                done(rx)
            else:
                failed(rx, rx.failed)
        return len(self.rx) < count
