"""Same-node transport: pages are written straight into the receiver's shared-memory KV pool.

Address: ``shm:<path of a Unix domain socket>`` (the control channel, `_channel_transport`).

Direct path (one copy). The receiver allocates its pool with `ShmTransport.allocate_pool` (a
named POSIX shared-memory region viewed as the pool tensor) and registers it; the welcome frame
of every handshake tells the sender the region name and pool geometry. For a message with pages
whose header names ``manifest.dst_block_ids`` (valid for that pool, same block shape and dtype),
the sender maps the region once per link and copies the pages of `src_block_ids` straight to
`dst_block_ids` (runs of consecutive ids as one slice copy), then sends the header. The receiver's
`poll()` returns ``Message(peer, header | {"direct": True}, None)``: the pages are in place.

Staging path (two copies). Without a shared-memory pool on the receiver, or without dst ids in
the header, the sender copies the pages into a staging ring (a region it owns, one per link)
and the receiver copies them out into `Message.pages` (``header["direct"]`` is False) and
returns a credit so the sender can reuse that part of the ring.

Regions are named ``tandem-kv-<endpoint_id>-<kind><n>``; `close()` unlinks those this endpoint
created (so does a finalizer at interpreter exit, and multiprocessing's resource tracker if the
process is killed).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing.util as mp_util
import os
import socket
import tempfile
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer._channel_transport import ChannelTransport
from tandem.kv_transfer._hugepages import allocate_hugepage_pool
from tandem.kv_transfer._shm_region import ShmRegion, is_region_name, new_endpoint_id
from tandem.kv_transfer._socket_channel import (
    Conn,
    FrameError,
    Link,
    Outgoing,
    consecutive_runs,
    dtype_name,
    encode_frame,
    parse_dtype,
    parse_shape,
    send_frame,
    valid_block_ids,
)
from tandem.kv_transfer.base import Message
from tandem.kv_transfer.manifest import TransferError

_ALIGN = 64


Rows = Any
"""Blocks as rows of raw bytes: a numpy ``(n, bytes)`` view on CPU, a uint8 tensor elsewhere."""


def as_rows(t: torch.Tensor) -> Rows:
    """`t`'s first dimension as rows of raw bytes (a view; numpy on CPU, so copies are one
    single-threaded memcpy each with no torch dispatch overhead)."""
    rows = t.view(torch.uint8).reshape(t.shape[0], -1)
    return rows.numpy() if rows.device.type == "cpu" else rows


def copy_rows(dst: Rows, src: Rows) -> None:
    """`dst[...] = src` for equal-shape row blocks from `as_rows`."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        as_tensor = torch.from_numpy
        d = as_tensor(dst) if isinstance(dst, np.ndarray) else dst
        d.copy_(as_tensor(src) if isinstance(src, np.ndarray) else src)


@dataclass(eq=False)
class _LinkState:
    """Sender side of a link: the peer's mapped pool (if any) and this link's staging ring."""

    peer_region: ShmRegion | None = None
    peer_pool: torch.Tensor | None = None
    peer_rows: Rows = None
    ring: ShmRegion | None = None
    ring_bytes: np.ndarray | None = None
    outstanding: deque[tuple[int, int, int]] = field(default_factory=deque)  # seq, offset, size
    next_seq: int = 0


@dataclass(eq=False)
class _ConnState:
    """Receiver side of a connection: the peer's staging ring, mapped on first use."""

    staging: ShmRegion | None = None
    staging_bytes: np.ndarray | None = None


class _Owned:
    """What an endpoint must remove when it goes away (kept apart from it for the finalizer)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.regions: dict[str, ShmRegion] = {}

    def drop(self, name: str) -> None:
        region = self.regions.pop(name, None)
        if region is not None:
            region.unlink()
            region.close()

    def release(self) -> None:
        for name in list(self.regions):
            self.drop(name)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)


def _ring_fit(outstanding: deque[tuple[int, int, int]], capacity: int, size: int) -> int | None:
    """Where `size` bytes fit in a ring whose in-use ranges are `outstanding` (FIFO order)."""
    if not outstanding:
        return 0 if size <= capacity else None
    first = outstanding[0][1]
    _, last_off, last_size = outstanding[-1]
    end = last_off + last_size
    if last_off >= first:  # not wrapped: free space is [end, capacity) and [0, first)
        if end + size <= capacity:
            return end
        return 0 if size <= first else None
    return end if end + size <= first else None


class ShmTransport(ChannelTransport):
    """Shared-memory transport for endpoints on one node (see the module docstring).

    Options: `socket_dir` (default: the temp dir), `staging_bytes` (initial size of each
    link's staging ring; grown on demand), `timeout` (seconds for connect, handshake and a full
    staging ring).
    """

    name = "shm"

    def __init__(
        self,
        auth_token: str,
        *,
        socket_dir: str | None = None,
        staging_bytes: int = 64 << 20,
        timeout: float = 30.0,
    ) -> None:
        super().__init__(auth_token, timeout=timeout)
        self.endpoint_id = new_endpoint_id()
        """Names this endpoint's regions and socket (``tandem-kv-<endpoint_id>...``)."""
        self.staging_bytes = int(staging_bytes)
        directory = socket_dir or tempfile.gettempdir()
        self._owned = _Owned(os.path.join(directory, f"tandem-kv-{self.endpoint_id}.sock"))
        self._finalizer = weakref.finalize(self, self._owned.release)
        # multiprocessing children leave through os._exit(), skipping atexit: clean up there too.
        mp_util.Finalize(self, self._owned.release, exitpriority=10)
        self._names = itertools.count()
        self._pool_regions: dict[int, str] = {}  # data_ptr of an allocated pool -> region name
        self._announce: dict[str, Any] | None = None
        self._pool_rows: Rows = None
        self._start()

    # ------------------------------------------------------------------- pools
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
        """A zero-filled CPU `KVCachePool` living in a shared-memory region of this endpoint.

        Register it with `register_pool` to receive pages directly into it. The region is
        unlinked at `close()`; the pool stays usable in this process after that.

        `send_only`: the pool of an endpoint that never receives pages (a prefill worker), in
        private memory on transparent huge pages instead. Its copies into a receiver's shared
        pool then run at about memcpy speed: shared memory gets no huge pages on most kernels
        (``shmem_enabled``), and a copy between two pools of 4 KiB pages is slower, every page
        costing a TLB miss (measured 9.6 against 11-12.5 GB/s in a VM).
        """
        if self._closed:
            raise TransferError("transport is closed")
        if send_only:
            return allocate_hugepage_pool(
                num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype
            )
        nbytes = KVCachePool.bytes_for(
            num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype
        )
        region = ShmRegion.create(self._region_name("p"), nbytes)
        self._owned.regions[region.name] = region
        shape = KVCachePool.shape_for(num_blocks, num_layers, block_size, num_kv_heads, head_dim)
        tensor = region.tensor(dtype, shape)
        tensor.view(torch.uint8).reshape(-1).numpy().fill(0)  # touch every page once, now
        pool = KVCachePool(
            num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype, tensor=tensor
        )
        self._pool_regions[tensor.data_ptr()] = region.name
        return pool

    def register_pool(self, pool: KVCachePool) -> None:
        """Sends read from `pool`; peers that connect later write straight into it when it came
        from `allocate_pool` (otherwise they stage). Register before publishing the address."""
        super().register_pool(pool)
        self._pool_rows = as_rows(pool.tensor)
        region = self._pool_regions.get(pool.tensor.data_ptr())
        if region is None or pool.device.type != "cpu":
            self._announce = None
            return
        self._announce = {
            "region": region,
            "num_blocks": pool.num_blocks,
            "block_shape": list(pool.block_shape),
            "dtype": dtype_name(pool.dtype),
        }

    def _region_name(self, kind: str) -> str:
        return f"tandem-kv-{self.endpoint_id}-{kind}{next(self._names)}"

    # ------------------------------------------------------------- connections
    def _open_listener(self) -> tuple[socket.socket, str]:
        path = self._owned.socket_path
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(64)
        return listener, f"shm:{path}"

    def _connect(self, peer: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(peer.removeprefix("shm:"))
        except BaseException:
            sock.close()
            raise
        return sock

    def _accept_hello(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        conn.state = _ConnState()
        return {"pool": self._announce}

    def _connected(self, link: Link) -> None:
        state = _LinkState()
        link.state = state
        pool = link.welcome.get("pool")
        if pool is None:
            return
        if not isinstance(pool, dict) or not is_region_name(pool.get("region")):
            raise FrameError(f"{link.peer} announced a bad pool {pool!r}")
        num_blocks = parse_shape([pool.get("num_blocks")], 1)[0]
        shape = (num_blocks, *parse_shape(pool.get("block_shape"), 5))
        region = ShmRegion.attach(pool["region"], populate=True)
        state.peer_region = region
        state.peer_pool = region.tensor(parse_dtype(pool.get("dtype")), shape)
        state.peer_rows = as_rows(state.peer_pool)

    def _release_link(self, link: Link) -> None:
        state = link.state
        if not isinstance(state, _LinkState):
            return
        state.peer_pool = state.peer_rows = None
        if state.peer_region is not None:
            state.peer_region.close()
        with self._cond:
            ring, state.ring, state.ring_bytes = state.ring, None, None
            self._cond.notify_all()
        if ring is not None:
            self._owned.drop(ring.name)

    def _release_conn(self, conn: Conn) -> None:
        state = conn.state
        if isinstance(state, _ConnState) and state.staging is not None:
            state.staging.close()
            state.staging = state.staging_bytes = None

    def _release(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ sending
    def _transmit(self, link: Link, item: Outgoing) -> bytes | None:
        state: _LinkState = link.state
        pool = self._pool
        if not item.src_block_ids or pool is None:
            return encode_frame(f'{{"type":"msg","header":{item.header_json}}}')
        src, dst = item.src_block_ids, item.dst_block_ids
        peer_pool, peer_rows, rows = state.peer_pool, state.peer_rows, self._pool_rows
        if (
            peer_pool is not None
            and dst is not None
            and len(dst) == len(src)
            and tuple(peer_pool.shape[1:]) == pool.block_shape
            and peer_pool.dtype == pool.dtype
            and valid_block_ids(dst, peer_pool.shape[0])
        ):
            for s, d, n in consecutive_runs(src, dst):
                copy_rows(peer_rows[d : d + n], rows[s : s + n])
            return encode_frame(f'{{"type":"msg","direct":true,"header":{item.header_json}}}')
        self._flush(link)  # never wait for staging credits while holding back frames
        shape = pool.blocks_shape(len(src))
        nbytes = len(src) * pool.bytes_per_block
        seq, offset, ring, ring_bytes = self._reserve(link, nbytes)
        staged = ring_bytes[offset : offset + nbytes].reshape(len(src), -1)
        for s, d, n in consecutive_runs(src, range(len(src))):
            copy_rows(staged[d : d + n], rows[s : s + n])
        pages = {
            "region": ring.name,
            "offset": offset,
            "shape": list(shape),
            "dtype": dtype_name(pool.dtype),
            "seq": seq,
        }
        frame = f'{{"type":"msg","pages":{json.dumps(pages)},"header":{item.header_json}}}'
        return encode_frame(frame)

    def _reserve(self, link: Link, nbytes: int) -> tuple[int, int, ShmRegion, np.ndarray]:
        """Room for `nbytes` in the link's staging ring: (seq, offset, ring, its bytes);
        waits for credits."""
        state: _LinkState = link.state
        size = -(-nbytes // _ALIGN) * _ALIGN
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if link.failed or self._closed:
                    raise TransferError(f"link to {link.peer} is closed")
                ring = state.ring
                offset: int | None = None
                if ring is None or ring.size < size:
                    if not state.outstanding:  # (re)create it, large enough for this message
                        if ring is not None:
                            self._owned.drop(ring.name)
                        ring = ShmRegion.create(
                            self._region_name("s"), max(size, self.staging_bytes)
                        )
                        self._owned.regions[ring.name] = ring
                        state.ring = ring
                        state.ring_bytes = ring.tensor(torch.uint8, (ring.size,)).numpy()
                        offset = 0
                else:
                    offset = _ring_fit(state.outstanding, ring.size, size)
                if offset is not None and ring is not None and state.ring_bytes is not None:
                    seq = state.next_seq
                    state.next_seq += 1
                    state.outstanding.append((seq, offset, size))
                    return seq, offset, ring, state.ring_bytes
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(f"staging to {link.peer} timed out (peer not reading)")
                self._cond.wait(remaining)

    def _back_frame(self, link: Link, frame: dict[str, Any]) -> None:
        seq = frame.get("seq")
        if frame.get("type") != "free" or not isinstance(seq, int):
            super()._back_frame(link, frame)
            return
        state: _LinkState = link.state
        with self._cond:
            for i, entry in enumerate(state.outstanding):
                if entry[0] == seq:
                    del state.outstanding[i]
                    break
            self._cond.notify_all()

    # ---------------------------------------------------------------- receiving
    def _receive(self, conn: Conn, frame: dict[str, Any], header: dict[str, Any]) -> Message:
        if frame.get("direct") is True:
            header["direct"] = True
            return Message(conn.peer, header, None)
        pages = frame.get("pages")
        if pages is None:
            return Message(conn.peer, header, None)
        if not isinstance(pages, dict) or not is_region_name(pages.get("region")):
            raise FrameError(f"bad staged pages {pages!r}")
        offset, seq = pages.get("offset"), pages.get("seq")
        if not isinstance(offset, int) or not isinstance(seq, int):
            raise FrameError(f"bad staged pages {pages!r}")
        dtype = parse_dtype(pages.get("dtype"))
        shape = parse_shape(pages.get("shape"), 6)
        state: _ConnState = conn.state
        if state.staging is None or state.staging.name != pages["region"]:
            if state.staging is not None:
                state.staging.close()
                state.staging = state.staging_bytes = None
            state.staging = ShmRegion.attach(pages["region"], populate=True)
            state.staging_bytes = state.staging.tensor(torch.uint8, (state.staging.size,)).numpy()
        out = torch.empty(shape, dtype=dtype)
        raw = as_rows(out.reshape(1, -1)).reshape(-1)
        if state.staging_bytes is None or not 0 <= offset <= len(state.staging_bytes) - raw.size:
            raise FrameError(f"staged pages {pages!r} lie outside the staging region")
        np.copyto(raw, state.staging_bytes[offset : offset + raw.size])
        send_frame(conn.sock, {"type": "free", "seq": seq})
        header["direct"] = False
        return Message(conn.peer, header, out)
