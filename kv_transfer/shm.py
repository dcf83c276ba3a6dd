"""Same-node transport: pages are written straight into the receiver's KV pool.

Address: ``shm:<path of a Unix domain socket>`` (the control channel, `_channel_transport`).

Direct path (one copy). The receiver allocates its pool with `ShmTransport.allocate_pool` and
registers it; the welcome frame of every handshake tells the sender where the pool is and its
geometry. For a message with pages whose header names ``manifest.dst_block_ids`` (valid for that
pool, same block shape and dtype), the sender copies the pages of `src_block_ids` straight to
`dst_block_ids` (runs of consecutive ids as one copy each), then sends the header. The
receiver's `poll()` returns ``Message(peer, header | {"direct": True}, None)``: the pages are in
place. The pool is one of:

- private memory on transparent huge pages, written with cross-memory attach
  (`process_vm_writev`, `_cross_memory`) where the kernel allows it (same user, Yama's
  ``ptrace_scope`` 0): the fastest copy, as huge pages need no TLB miss per 4 KiB;
- otherwise a named POSIX shared-memory region, which the sender maps once per link.

Staging path (two copies). Without such a pool on the receiver, without dst ids in the header,
or where the kernel refuses the cross-memory write, the sender copies the pages into a staging
ring (a region it owns, one per link) and the receiver copies them out into `Message.pages`
(``header["direct"]`` is False) and returns a credit so the sender can reuse that part of the
ring.

Regions are named ``tandem-kv-<endpoint_id>-<kind><n>``; `close()` unlinks those this endpoint
created (so does a finalizer at interpreter exit, and multiprocessing's resource tracker if the
process is killed).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing.util as mp_util
import os
import socket
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _cross_memory, _pull_ring, _shm_pull
from tandem.kv_transfer._channel_transport import ChannelTransport
from tandem.kv_transfer._leftovers import remove_stale_regions, remove_stale_sockets
from tandem.kv_transfer._shm_link import ConnState, LinkState
from tandem.kv_transfer._shm_memory import Owned, Rows, as_rows, copy_rows
from tandem.kv_transfer._shm_pools import PoolKinds
from tandem.kv_transfer._shm_region import ShmRegion, new_endpoint_id
from tandem.kv_transfer._shm_staging import StagingRing
from tandem.kv_transfer._socket_channel import (
    Conn,
    Link,
    Outgoing,
    consecutive_runs,
    dtype_name,
    encode_frame,
    valid_block_ids,
)
from tandem.kv_transfer.base import Message
from tandem.kv_transfer.manifest import TransferError


class ShmTransport(ChannelTransport):
    """Shared-memory transport for endpoints on one node (see the module docstring).

    Options: `socket_dir` (default: the temp dir), `staging_bytes` (initial size of each
    link's staging ring; grown on demand), `timeout` (seconds for connect, handshake and a full
    staging ring), `cross_memory` (receive into a private huge-page pool written by
    cross-memory attach where the kernel allows it; False: always a shared-memory region),
    `pull` (offer receivers the pull path of `_shm_pull`: None, for pools from
    `allocate_pool(send_only=True)`; True, for any CPU pool; False, never).
    """

    name = "shm"

    def __init__(
        self,
        auth_token: str,
        *,
        socket_dir: str | None = None,
        staging_bytes: int = 64 << 20,
        timeout: float = 30.0,
        cross_memory: bool = True,
        pull: bool | None = None,
    ) -> None:
        super().__init__(auth_token, timeout=timeout)
        self.cross_memory = bool(cross_memory) and _cross_memory.available()
        """Whether `allocate_pool` gives receiving pools that peers write by cross-memory
        attach (asked for, and allowed here)."""
        self.endpoint_id = new_endpoint_id()
        """Names this endpoint's regions and socket (``tandem-kv-<endpoint_id>...``)."""
        self.staging_bytes = int(staging_bytes)
        directory = socket_dir or tempfile.gettempdir()
        remove_stale_sockets(directory)
        remove_stale_regions()
        self._owned = Owned(os.path.join(directory, f"tandem-kv-{self.endpoint_id}.sock"))
        self._finalizer = weakref.finalize(self, self._owned.release)
        # multiprocessing children leave through os._exit(), skipping atexit: clean up there too.
        mp_util.Finalize(self, self._owned.release, exitpriority=10)
        self._names = itertools.count()
        self.pull = pull
        """Offer the pull path to peers: None, when the registered pool came from
        `allocate_pool(send_only=True)` (a prefill worker's); True, for any CPU pool; False, never.
        """
        self._offered_ring: ShmRegion | None = None
        self._pools = PoolKinds(self._owned, self._region_name)
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
        """A zero-filled CPU `KVCachePool` that peers can write pages into directly: private
        memory on transparent huge pages written by cross-memory attach (`cross_memory`), or a
        shared-memory region of this endpoint.

        Register it with `register_pool` to receive pages directly into it. A region is
        unlinked at `close()`; the pool stays usable in this process after that.

        `send_only`: the pool of an endpoint that never receives pages (a prefill worker), in
        private memory on transparent huge pages instead. Its copies into a receiver's shared
        pool then run at about memcpy speed: shared memory gets no huge pages on most kernels
        (``shmem_enabled``), and a copy between two pools of 4 KiB pages is slower, every page
        costing a TLB miss (measured 9.6 against 11-12.5 GB/s in a VM).
        """
        if self._closed:
            raise TransferError("transport is closed")
        shape = (num_blocks, num_layers, block_size, num_kv_heads, head_dim)
        return self._pools.allocate(
            shape, dtype, send_only=send_only, cross_memory=self.cross_memory
        )

    def register_pool(self, pool: KVCachePool) -> None:
        """Sends read from `pool`; peers that connect later write straight into it when it came
        from `allocate_pool` (otherwise they stage). Register before publishing the address."""
        super().register_pool(pool)
        self._pool_rows = as_rows(pool.tensor)
        self._announce = self._pools.announcement(pool)

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

    def _hello_extra(self) -> dict[str, Any]:
        """Offers the pull path's ring to the peer this link is opening to, where it may serve."""
        if self._offers_pull():
            assert self._pool is not None
            ring = ShmRegion.create(
                self._region_name("r"), _pull_ring.CONTROL_BYTES + _shm_pull.RING_BYTES
            )
            self._owned.regions[ring.name] = ring
            self._offered_ring = ring  # (sender thread only, until `_connected` takes it)
            return {"pull": _shm_pull.offer(ring, self._pool)}
        return {}

    def _offers_pull(self) -> bool:
        if self.pull is False or not _pull_ring.supported():
            return False
        pool = self._pool
        if self.pull is None and not self._pools.is_send_only(pool):
            return False
        return _shm_pull.can_pull_from(pool)

    def _open_link(self, peer: str) -> Link:
        try:
            return super()._open_link(peer)
        finally:  # a ring offered to a peer that refused, or to a handshake that failed
            ring, self._offered_ring = self._offered_ring, None
            if ring is not None:
                self._owned.drop(ring.name)

    def _accept_hello(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        state = ConnState()
        conn.state = state
        offered = hello.get("pull")
        if offered is not None and self.pull is not False and _pull_ring.supported():
            state.reader = _shm_pull.reader_for(
                offered, conn, self._pool, self._inbox.put, self._address
            )
        return {"pool": self._announce, "pull": state.reader is not None}

    def _accepted(self, conn: Conn) -> None:
        reader = conn.state.reader if isinstance(conn.state, ConnState) else None
        if reader is not None:
            self._spawn(reader.run, "pull")

    def _control_frame(self, conn: Conn, frame: dict[str, Any]) -> None:
        reader = conn.state.reader if isinstance(conn.state, ConnState) else None
        if frame.get("type") == "wake" and reader is not None:
            reader.wake()
        else:
            super()._control_frame(conn, frame)

    def _connected(self, link: Link) -> None:
        state = LinkState()
        link.state = state
        ring, self._offered_ring = self._offered_ring, None
        if ring is not None:
            if link.welcome.get("pull") is True:
                state.pull = _shm_pull.PullWriter(ring, link.sock)
                return  # every message goes through the ring
            self._owned.drop(ring.name)
        state.attach(link.welcome.get("pool"), link.peer, link.sock, self._address)

    def _release_link(self, link: Link) -> None:
        state = link.state
        if not isinstance(state, LinkState):
            return
        state.detach()
        with self._cond:
            ring, state.staging = state.staging.region, StagingRing()
            pull, state.pull = state.pull, None
            self._cond.notify_all()
        for region in (ring, pull.region if pull is not None else None):
            if region is not None:
                self._owned.drop(region.name)

    def _release_conn(self, conn: Conn) -> None:
        state = conn.state
        if isinstance(state, ConnState):
            state.staging.close()
        if isinstance(state, ConnState) and state.reader is not None:
            state.reader.stop()
            state.reader.region.close()

    def _release(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ sending
    def send(self, peer: str, header: dict[str, Any], src_block_ids: Sequence[int] = ()) -> None:
        """Queues for the sender thread, or, on a link with a pull ring and nothing queued before
        it, appends the message to the ring right here (no thread woken; see `_shm_pull`)."""
        link = self._links.get(peer)
        pull = link.state.pull if link is not None and type(link.state) is LinkState else None
        if pull is not None and self._pool is not None:
            # As `_outgoing` checks, but touching less: this runs on a prefill's hot path
            # after every step, where the CPU caches are cold.
            ids = src_block_ids if type(src_block_ids) is list else list(map(int, src_block_ids))
            if valid_block_ids(ids, self._pool.num_blocks):
                with self._mutex:  # (against the sender thread)
                    if (
                        link.state.pull is pull  # type: ignore[union-attr]
                        and not self._closed
                        and self._busy_peer != peer
                        and not self._queues.get(peer)
                    ):
                        try:
                            if pull.write(ids, header):
                                return
                        except (TypeError, ValueError):
                            pass  # not JSON: `_outgoing` says what is wrong
        self._enqueue(self._outgoing(peer, header, src_block_ids))

    def _transmit(self, link: Link, item: Outgoing) -> bytes | None:
        state: LinkState = link.state
        if state.pull is not None:  # (`send` writes no record while this thread holds some)
            state.pull.write_waiting(item, self.timeout, lambda: link.failed or self._closed)
            return None
        pool = self._pool
        if not item.src_block_ids or pool is None:
            return encode_frame(f'{{"type":"msg","header":{item.header_json}}}')
        src, dst, rows = item.src_block_ids, item.dst_block_ids, self._pool_rows
        if dst is not None and (
            (state.target is not None and state.write_across(pool, src, dst))
            or state.write_mapped(pool, rows, src, dst)
        ):
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

    def _flush(self, link: Link) -> None:
        """Writes the pages queued for the peer's private pool (one system call for the batch),
        then the frames."""
        state = link.state
        if isinstance(state, LinkState):
            try:
                state.flush_across(link.peer)
            except TransferError:
                link.pending.clear()  # those frames would announce pages that are not there
                raise
        super()._flush(link)

    def _reserve(self, link: Link, nbytes: int) -> tuple[int, int, ShmRegion, np.ndarray]:
        """Room for `nbytes` in the link's staging ring: (seq, offset, ring, its bytes);
        waits for credits."""
        staging: StagingRing = link.state.staging
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if link.failed or self._closed:
                    raise TransferError(f"link to {link.peer} is closed")
                placed = staging.place(
                    nbytes, self.staging_bytes, self._new_staging_region, self._drop_region
                )
                if placed is not None:
                    assert staging.region is not None and staging.data is not None
                    return placed[0], placed[1], staging.region, staging.data
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(f"staging to {link.peer} timed out (peer not reading)")
                self._cond.wait(remaining)

    def _new_staging_region(self, size: int) -> ShmRegion:
        region = ShmRegion.create(self._region_name("s"), size)
        self._owned.regions[region.name] = region
        return region

    def _drop_region(self, region: ShmRegion) -> None:
        self._owned.drop(region.name)

    def _back_frame(self, link: Link, frame: dict[str, Any]) -> None:
        seq = frame.get("seq")
        if frame.get("type") != "free" or not isinstance(seq, int):
            super()._back_frame(link, frame)
            return
        with self._cond:
            link.state.staging.free(seq)
            self._cond.notify_all()

    # ---------------------------------------------------------------- receiving
    def _receive(self, conn: Conn, frame: dict[str, Any], header: dict[str, Any]) -> Message:
        if frame.get("direct") is True:
            header["direct"] = True
            return Message(conn.peer, header, None)
        pages = frame.get("pages")
        if pages is None:
            return Message(conn.peer, header, None)
        out = conn.state.staging.take(pages, conn.sock)
        header["direct"] = False
        return Message(conn.peer, header, out)
