"""The shm transport's pull path: the receiver copies pages out of the sender's pool itself.

On the push path the sender's own thread copies each message's pages, so a prefill engine that
streams a chunk after every step wakes that thread and shares its GIL with it while it computes
the next chunk. On the pull path `send` only appends a record (the header and the source block
ids) to a ring in shared memory (`RecordRing`) and returns: no system call, no thread woken in
the sending process. A reader thread in the receiving process polls the ring, copies the pages
straight from the sender's pool into its own with cross-memory attach (`process_vm_readv`), and
hands the message on, in ring order.

The reader polls while a stream of chunks is under way (it saw a chunk whose manifest says
``last: false`` within `STREAM_GAP_S`), every tenth of the time between the stream's chunks
(`POLL_S` bounds it: a prefill step apart, the chunks need not be seen sooner), and sleeps
otherwise: each look takes the receiving process's GIL from its decode engine, and a core from a
prefill on a small host. A sender that writes a chunk to a sleeping reader's ring sends it a
``wake`` frame on the link's socket, so a stream costs the sender one system call, at its
start. Any other message (a request's last chunk, which commits it; a cancel) is not left
waiting for a slow look either: it comes with a wake frame unless the reader looks often
(`RecordRing.reader_state`). A link offers the ring in its hello
(`offer`); the receiver accepts it only if the kernel lets it read the sender's memory (the
process at the other end of the socket, as the kernel reports it) and the CPU orders stores
(`RecordRing` on x86-64).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Literal

import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _chunk_records, _cross_memory
from tandem.kv_transfer._pull_ring import ASLEEP, AWAKE, POLLING_SLOWLY, RecordRing
from tandem.kv_transfer._shm_region import ShmRegion, is_region_name
from tandem.kv_transfer._socket_channel import (
    Conn,
    FrameError,
    Outgoing,
    dst_block_ids_of,
    send_frame,
    shutdown_and_close,
    valid_block_ids,
)
from tandem.kv_transfer.base import Message, header_json
from tandem.kv_transfer.manifest import TransferError

log = logging.getLogger(__name__)

RING_BYTES = 1 << 20
"""Each link's record ring: thousands of records (a header and two id lists, a few hundred
bytes each), in /dev/shm, which containers often keep small (64 MiB by default in Docker)."""
POLL_S = (0.001, 0.02)
"""How often a reader looks at its ring while a stream is under way: a tenth of the time
between the stream's last two chunks, within these bounds."""
STREAM_GAP_S = 2.0
"""A stream with no chunk for this long is not waited for by polling any more."""
BURST_S = 0.002
"""After a record, a reader looks again at once for this long before it sleeps (records sent
back to back then cost no wake each)."""
IDLE_CHECK_S = 0.05
"""How often a sleeping reader looks anyway (in case a wake frame crossed its going to sleep)."""
GROUP_BYTES = 8 << 20
"""Pages per read when a look finds several messages: copy threads read a group while the
reader parses the next (see `PullReader._drain`). A look that finds less is read in one call on
the reader's thread. 8 MiB: 1 MiB messages read at 0.92-1.13 of memcpy in eight runs here
against 0.64-1.18 with 4 MiB (not traced: fewer hand-offs to the copy threads, presumably); a
backlog's first message then waits for at most ~1.5 ms of copying."""
COPY_THREADS = 2
"""Threads that read a group aside, each a share of its pages: one thread's copy is bound by
the latency of its memory accesses, not by the memory's bandwidth (in a 2-core VM one read
4-4.6 GB/s, two ~6-7 GB/s for 4 MiB and more)."""


def can_pull_from(pool: KVCachePool | None) -> bool:
    """Whether peers could copy pages out of `pool` (in this process's CPU memory, contiguous)."""
    return (
        pool is not None
        and pool.device.type == "cpu"
        and pool.tensor.is_contiguous()
        and _cross_memory.available()
    )


def offer(ring: ShmRegion, pool: KVCachePool) -> dict[str, Any]:
    """The hello field that offers a link's ring, and where the pages are read from."""
    return {"ring": ring.name, "pool": _cross_memory.describe(pool)}


def reader_for(
    offered: object,
    conn: Conn,
    pool: KVCachePool | None,
    deliver: Callable[[Message], None],
    where: str,
) -> PullReader | None:
    """The reader for a hello's offer, if this process may read from the sender (the process
    at the other end of `conn`'s socket, as the kernel reports it); else None (log says why).
    `where` names this endpoint in the log."""
    if not isinstance(offered, dict) or not is_region_name(offered.get("ring")):
        raise FrameError(f"bad pull offer {offered!r}")
    why = "the kernel does not let this process read its memory"
    try:
        source = _cross_memory.remote_pool(offered.get("pool"), conn.sock)
        ring = ShmRegion.attach(offered["ring"]) if source is not None else None
    except OSError as exc:
        source, ring, why = None, None, str(exc)
    if source is None or ring is None:
        log.info("%s: cannot pull pages from %s (%s): it will push them", where, conn.peer, why)
        return None

    def fail(exc: BaseException) -> None:
        log.warning("%s: pulling pages from %s failed: %s", where, conn.peer, exc)
        shutdown_and_close(conn.sock)

    return PullReader(conn.peer, ring, source, pool, deliver, fail)


def ring_of(region: ShmRegion) -> RecordRing:
    return RecordRing(region.buffer())


class PullWriter:
    """Sender side of one link: appends records to its ring, wakes a sleeping reader."""

    def __init__(self, region: ShmRegion, sock: Any) -> None:
        self.region = region
        self.ring = ring_of(region)
        self.sock = sock
        self._lock = threading.Lock()
        self._layouts: dict[str, int] = {}  # layout JSON -> its index on this link

    def write(self, src_block_ids: Sequence[int], header: dict[str, Any]) -> bool:
        """Appends a message; False when the ring is full (the reader is behind). A plain chunk
        goes as a compact record, anything else as JSON. `TransferError` for a message larger
        than the whole ring; TypeError or ValueError for a header that is not JSON."""
        # (Runs once per chunk on a prefill's publishing or engine thread: every line is slow.)
        plain = _chunk_records.plain_chunk_records(header, src_block_ids, self._layouts)
        if plain is not None:
            layout, records = plain
            if layout is not None:
                # (no wake: the chunk's record, right after, wakes the reader if need be)
                if not self._append(records[0], "never"):
                    return False
                self._layouts[layout] = len(self._layouts)
            return self._append(records[-1], "asleep")
        return self.write_text(src_block_ids, header_json(header))

    def write_text(self, src_block_ids: Sequence[int], header_json: str) -> bool:
        """`write` of a header's JSON text."""
        ids = ",".join(map(str, map(int, src_block_ids)))
        return self._append(f'{{"src":[{ids}],"header":{header_json}}}'.encode(), "waiting")

    def _append(self, record: bytes, wake: Literal["waiting", "asleep", "never"]) -> bool:
        """Appends `record`, then wakes the reader: if it is not looking often ("waiting": a
        message that must not wait for a slow look), if it is asleep (a stream's chunk: the
        reader looks at its ring while a stream is under way), or never."""
        ring = self.ring
        if not ring.write(record):
            if len(record) + 8 > ring.capacity:
                raise TransferError(f"a header of {len(record)} bytes exceeds the pull ring")
            return False
        with self._lock:  # (an atomic operation: the record is visible before the state is read)
            state = ring.reader_state
        woken = wake != "never" and (
            state == ASLEEP or (state == POLLING_SLOWLY and wake == "waiting")
        )
        if woken:  # (a peer that is gone: the link's watcher reports it through `poll`)
            with contextlib.suppress(OSError):
                send_frame(self.sock, '{"type":"wake"}')
        return True

    def write_waiting(self, item: Outgoing, timeout: float, failed: Callable[[], bool]) -> None:
        """`write`, waiting for room up to `timeout` seconds (the sender thread's way)."""
        deadline = time.monotonic() + timeout
        while not self.write_text(item.src_block_ids, item.header_json):
            if failed():
                raise TransferError("link closed while its ring was full")
            if time.monotonic() > deadline:
                raise TransferError("the peer is not reading its ring (full)")
            time.sleep(POLL_S[0])


class PullReader:
    """Receiver side of one connection: a thread that drains the ring into `deliver` (`run`),
    and `wake`, which the connection's socket thread calls for a wake frame: it drains the ring
    itself (it is awake already; one thread hand-off fewer), then wakes the thread."""

    def __init__(
        self,
        peer: str,
        region: ShmRegion,
        source: _cross_memory.RemotePool,
        pool: KVCachePool | None,
        deliver: Callable[[Message], None],
        fail: Callable[[BaseException], None],
    ) -> None:
        self.peer = peer
        self.region = region
        self.ring = ring_of(region)
        self.source = source
        self.pool = pool
        self.deliver = deliver
        self.fail = fail
        self._wake = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()  # one drainer at a time
        self._streams: dict[str, float] = {}  # request id -> when its last chunk so far came
        self._layouts: list[dict[str, Any]] = []  # announced for compact records, in order
        self._poll_s = POLL_S[1]  # while a stream is under way (until its chunks are timed)
        self._last_chunk_at = 0.0  # when the last chunk of a stream under way came
        self._copy_thread: ThreadPoolExecutor | None = None  # started by the first backlog

    def wake(self) -> None:
        with self._lock:
            self._drain()
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        with self._lock:  # (after a drain under way: its reads are done)
            copier, self._copy_thread = self._copy_thread, None
        if copier is not None:
            copier.shutdown(wait=False)

    def run(self) -> None:
        last = 0.0
        try:
            while not self._stopped:
                now = time.monotonic()
                with self._lock:
                    if self._drain():
                        last = now
                        continue
                    streams = self._streams
                    for rid in [r for r, at in streams.items() if now - at > STREAM_GAP_S]:
                        del streams[rid]
                if streams:
                    self._pause(self._poll_s)
                    continue
                if now - last < BURST_S:  # messages back to back: the next one is near
                    time.sleep(0)
                    continue
                self._pause(IDLE_CHECK_S, ASLEEP)
        except Exception as exc:  # a bad record or a copy that failed ends the connection
            if not self._stopped:
                self.fail(exc)

    def _pause(self, seconds: float, state: int = POLLING_SLOWLY) -> None:
        """Waits up to `seconds` for a wake, having told writers it does (`state`), unless a
        record came meanwhile. A pause of one `POLL_S` step sleeps, and writers are not told."""
        if state != ASLEEP and seconds <= POLL_S[0]:
            time.sleep(seconds)
            return
        self.ring.set_state(state)
        self._wake.clear()  # (a lock: orders the store above before the load below)
        if not self.ring.has_records() and not self._stopped:
            self._wake.wait(seconds)
        self.ring.set_state(AWAKE)

    def _drain(self) -> int:
        """Delivers what the ring holds, in ring order; notes which streams are under way (hold
        `_lock`). Records that came together are read a group at a time (`GROUP_BYTES` of
        pages), on the copy thread while this one parses the next group and delivers the one
        before: a look that finds many messages (a backlog, a burst of large chunks) keeps
        copying while the Python per record runs. A group is delivered once its pages are in."""
        records = self.ring.read()
        if not records:
            return 0
        groups: deque[tuple[list[Future[None]], list[Message]]] = deque()
        runs: list[tuple[int, int, int]] = []
        messages: list[Message] = []
        nbytes, last = 0, len(records) - 1
        try:
            for i, record in enumerate(records):
                known = len(runs)
                message = self._message(record, runs)
                if message is not None:
                    messages.append(message)
                for run in runs[known:]:
                    nbytes += run[2]
                if nbytes >= GROUP_BYTES and i < last:  # more follow: read this group aside
                    groups.append((self._read_aside(runs), messages))
                    runs, messages, nbytes = [], [], 0
                    if len(groups) > 1:  # one read running, one queued behind it
                        self._deliver(*groups.popleft())
            if groups and runs:
                groups.append((self._read_aside(runs), messages))
            else:
                if runs:  # (one group: read here, no hand-off)
                    self._read(runs)
                groups.append(([], messages))
            while groups:
                self._deliver(*groups.popleft())
        finally:  # (a read or a record that failed: no copy may land after the link is gone)
            for futures, _ in groups:
                wait_futures(futures)
        return len(records)

    def _read(self, runs: list[tuple[int, int, int]]) -> None:
        _cross_memory.read(self.source.pid, runs)

    def _read_aside(self, runs: list[tuple[int, int, int]]) -> list[Future[None]]:
        """Starts reading `runs` on the copy threads, `COPY_THREADS` shares of their bytes; none
        when read here (a stopped reader starts no thread; `stop` shuts down those that a
        drain under way started)."""
        if self._stopped:
            self._read(runs)
            return []
        if self._copy_thread is None:
            self._copy_thread = ThreadPoolExecutor(
                COPY_THREADS, thread_name_prefix="tandem-kv-pull-copy"
            )
        return [
            self._copy_thread.submit(self._read, s)
            for s in _cross_memory.split_runs(runs, COPY_THREADS)
        ]

    def _deliver(self, pages_read: list[Future[None]], messages: list[Message]) -> None:
        """Delivers `messages` once their pages are in (`pages_read` done)."""
        wait_futures(pages_read)  # (all of them, before one that failed raises)
        for future in pages_read:
            future.result()
        streams = self._streams
        for message in messages:
            manifest = message.header.get("manifest")
            if isinstance(manifest, dict) and isinstance(manifest.get("request_id"), str):
                if manifest.get("last") is False:
                    now = streams[manifest["request_id"]] = time.monotonic()
                    gap, self._last_chunk_at = now - self._last_chunk_at, now
                    if gap < STREAM_GAP_S:
                        self._poll_s = min(max(gap / 10, POLL_S[0]), POLL_S[1])
                else:
                    streams.pop(manifest["request_id"], None)
            self.deliver(message)

    def _message(self, record: bytes, runs: list[tuple[int, int, int]]) -> Message | None:
        """The message of a ring record (None for a layout record); adds the copies its pages
        need to `runs`."""
        kind = record[0] if record else None
        if kind == _chunk_records.LAYOUT:
            self._layouts.append(_chunk_records.parse_layout(record))
            return None
        if kind == _chunk_records.CHUNK:
            header, src = _chunk_records.parse_chunk(record, self._layouts)
        else:
            header, src = _json_record(record)
        if not src:
            return Message(self.peer, header, None)
        if not valid_block_ids(src, self.source.num_blocks):
            raise FrameError(f"ring record names blocks {src} outside the sender's pool")
        dst = dst_block_ids_of(header)
        pool, source = self.pool, self.source
        if (
            pool is not None
            and dst is not None
            and len(dst) == len(src)
            and source.matches(pool)
            and valid_block_ids(dst, pool.num_blocks)
        ):
            runs += source.runs(pool.tensor.data_ptr(), dst, src)
            header["direct"] = True
            return Message(self.peer, header, None)
        pages = torch.empty((len(src), *source.block_shape), dtype=source.dtype)
        runs += source.runs(pages.data_ptr(), range(len(src)), src)
        header["direct"] = False
        return Message(self.peer, header, pages)


def _json_record(record: bytes) -> tuple[dict[str, Any], list[int]]:
    """The header and source block ids of a JSON ring record."""
    try:
        obj = json.loads(record)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"ring record is not JSON: {exc}") from None
    src, header = obj.get("src") if isinstance(obj, dict) else None, None
    if isinstance(obj, dict) and isinstance(obj.get("header"), dict):
        header = obj["header"]
    if header is None or not isinstance(src, list) or not set(map(type, src)) <= {int}:
        raise FrameError("bad ring record")
    return header, src
