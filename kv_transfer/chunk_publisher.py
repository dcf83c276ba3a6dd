"""Hands a prefill's chunks of pages to the transport from a thread of their own.

A prefill engine streams a request's pages as a chunk after every step. Writing the chunk's
header and handing it to the transport on the engine's thread costs ~100 us a chunk on a CPU
host: it runs right after a forward pass, when every line of Python meets cold caches, and it
is on the first token's path. With a `ChunkPublisher` the engine's thread only pins the blocks,
notes the chunk (`KVSender`'s bookkeeping) and appends it here; this thread writes the header
and calls `send` while the engine computes the next chunk (torch releases the GIL in its ops).

The thread does not need waking for every chunk, which would cost the engine's thread a system
call each time: while chunks keep coming it looks every quarter of a step (`POLL_S`), and it
sleeps after a quiet `STREAM_GAP_S` (the next chunk then wakes it, once). A chunk therefore
leaves within a quarter of a step after its step, long before the step after it ends.

Ordering: chunks of one request leave in order. Whatever the engine's thread sends itself to a
peer (a request's last chunk, a cancel) must not overtake chunks still queued here: it calls
`flush` (send what is queued, now, on its own thread) or `drop` (forget a request's queued
chunks, before its blocks are unpinned) first. Both wait for the chunk this thread may be
sending, and no longer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from tandem.kv_transfer.base import KVTransport
from tandem.kv_transfer.manifest import TransferError

log = logging.getLogger(__name__)

POLL_S = (0.001, 0.01, 0.05)
"""How often the thread looks for chunks while a stream is under way: a quarter of the time
between the last two chunks (a prefill step) within the first and last of these bounds; the
middle one until two chunks were timed. Each look takes the GIL."""
STREAM_GAP_S = 2.0
"""With no chunk for this long, the thread sleeps until the next one wakes it."""


class QueuedChunk(NamedTuple):
    """A chunk the engine's thread noted (its blocks pinned), to be sent as it says."""

    peer: str
    request_id: str
    chunk_index: int
    num_tokens: int
    src_block_ids: list[int]
    dst_block_ids: list[int]


class ChunkPublisher:
    """`add` queues a chunk; a thread writes its header with `write_header` and sends it.
    Failures come back through `failures()`. `add`, `flush` and `drop` are for one thread
    (the engine's)."""

    def __init__(
        self,
        transport: KVTransport,
        write_header: Callable[[QueuedChunk], dict[str, object]],
    ) -> None:
        self.transport = transport
        self.write_header = write_header
        self._queue: deque[QueuedChunk] = deque()
        self._lock = threading.Lock()  # held while a chunk is being sent
        self._wake = threading.Event()
        self._asleep = False
        self._closed = False
        self._last_add = 0.0
        self._failed: deque[tuple[str, str]] = deque()  # (request id, error)
        self._thread = threading.Thread(target=self._run, name="kv-chunk-publisher", daemon=True)
        self._thread.start()

    # ---- the engine's thread
    def add(self, chunk: QueuedChunk) -> None:
        self._queue.append(chunk)
        self._last_add = time.monotonic()
        if self._asleep:
            self._wake.set()

    def flush(self) -> None:
        """Sends every queued chunk now, on the calling thread."""
        with self._lock:
            self._publish()

    def drop(self, request_id: str) -> int:
        """Forgets `request_id`'s queued chunks (it ended); returns how many."""
        with self._lock:
            kept = [c for c in self._queue if c.request_id != request_id]
            dropped = len(self._queue) - len(kept)
            if dropped:
                self._queue.clear()
                self._queue.extend(kept)
            return dropped

    def failures(self) -> list[tuple[str, str]]:
        """(request id, error) of the chunks whose `send` failed since the last call."""
        failed = []
        while self._failed:  # (the thread may append meanwhile: a deque's ends are atomic)
            failed.append(self._failed.popleft())
        return failed

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # ---- the thread
    def _publish(self, count: int | None = None) -> None:
        """Sends the first `count` queued chunks (all: None); hold `_lock`."""
        queue = self._queue
        while queue and (count is None or count > 0):
            chunk = queue[0]
            try:
                header = self.write_header(chunk)
                # Drop the GIL between the two halves of the work: an engine thread that wants
                # it back (a torch op ended) waits for half of it at most.
                time.sleep(0)
                self.transport.send(chunk.peer, header, chunk.src_block_ids)
            except Exception as exc:  # (a bug too: the request fails, the thread goes on)
                if not isinstance(exc, TransferError):
                    log.exception("sending a chunk of %s failed", chunk.request_id)
                self._failed.append((chunk.request_id, f"could not send the pages: {exc}"))
            queue.popleft()
            count = None if count is None else count - 1

    def _run(self) -> None:
        low, poll_s, high = POLL_S
        seen = 0.0  # the last chunk's `add` time this thread saw
        while not self._closed:
            last = self._last_add
            if last != seen:
                if 0 < last - seen < STREAM_GAP_S:
                    poll_s = min(max((last - seen) / 4, low), high)
                seen = last
            while self._queue:  # one at a time: `flush` and `drop` may cut in between
                with self._lock:
                    self._publish(1)
            if time.monotonic() - last < STREAM_GAP_S:
                time.sleep(poll_s)
                continue
            self._asleep = True
            self._wake.clear()
            if not self._queue and not self._closed:
                self._wake.wait()
            self._asleep = False
