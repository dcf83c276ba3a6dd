"""Hands a prefill's chunks of pages to the transport from a thread of their own.

A prefill engine streams a request's pages as a chunk after every step. Everything a chunk needs
beyond pinning its blocks (its index, destination blocks, the records the acknowledgement is
matched against, the header, the `send`) costs ~25 us on the engine's thread on a CPU host: it
runs right after a forward pass, when every line of Python meets cold caches, and it is on the
first token's path. With a `ChunkPublisher` the engine's thread only pins the blocks and appends
them here (`add`); this thread turns each into a message with the sender's `prepare` and sends
it while the engine computes the next chunk (torch releases the GIL in its ops).

The thread does not need waking for every chunk, which would cost the engine's thread a system
call each time: while chunks keep coming it looks every quarter of a step (`POLL_S`), and it
sleeps after a quiet `STREAM_GAP_S` (the next chunk then wakes it, once). A chunk therefore
leaves within a quarter of a step after its step, long before the step after it ends.

Ordering: chunks of one request leave in order. Whatever the engine's thread sends itself to a
peer (a request's last chunk, a cancel) must not overtake chunks still queued here: it calls
`flush` (send what is queued, now, on its own thread) or `drop` (forget a request's queued
chunks, before its blocks are unpinned) first. Both wait for the chunk this thread may be
sending, and no longer; so does `exclusive`, under which no chunk is prepared or sent (the
engine's thread reads or writes what `prepare` writes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tandem.kv_transfer.base import KVTransport
from tandem.kv_transfer.manifest import TransferError

log = logging.getLogger(__name__)

POLL_S = (0.001, 0.01, 0.05)
"""How often the thread looks for chunks while a stream is under way: a quarter of the time
between the last two looks that found some (about a prefill step) within the first and last of
these bounds; the middle one until two were timed. Each look takes the GIL."""
STREAM_GAP_S = 2.0
"""With no chunk for this long, the thread sleeps until the next one wakes it."""


Prepared = tuple[str, dict[str, Any], list[int]]
"""(peer, header, source block ids): one `send`."""


class ChunkPublisher:
    """`add` queues an item of a request; a thread turns it into a message with `prepare` and
    sends it. Failures come back through `failures()`. `add`, `flush`, `drop` and `exclusive`
    are for one thread (the engine's)."""

    def __init__(
        self,
        transport: KVTransport,
        prepare: Callable[[Any], Prepared],
    ) -> None:
        self.transport = transport
        self.prepare = prepare
        self._queue: deque[tuple[str, Any]] = deque()  # (request id, item)
        self._lock = threading.Lock()  # held while a chunk is being sent
        self._wake = threading.Event()
        self._asleep = False
        self._closed = False
        self._failed: deque[tuple[str, str]] = deque()  # (request id, error)
        self._thread = threading.Thread(target=self._run, name="kv-chunk-publisher", daemon=True)
        self._thread.start()

    # ---- the engine's thread
    def add(self, request_id: str, item: Any) -> None:
        """Queues `item` (`prepare` makes it a message). The fewest lines: this runs on the
        engine's thread after each step of a streaming prefill, with cold caches."""
        self._queue.append((request_id, item))
        if self._asleep:
            self._wake.set()

    def flush(self) -> None:
        """Sends every queued chunk now, on the calling thread."""
        with self._lock:
            self._publish()

    def drop(self, request_id: str) -> list[Any]:
        """Forgets `request_id`'s queued items (it ended); returns them, in order."""
        with self._lock:
            dropped = [item for rid, item in self._queue if rid == request_id]
            if dropped:
                kept = [entry for entry in self._queue if entry[0] != request_id]
                self._queue.clear()
                self._queue.extend(kept)
            return dropped

    @contextmanager
    def exclusive(self, flush: bool = False) -> Iterator[None]:
        """Within it, this thread prepares and sends nothing (`flush`: after sending what is
        queued, on the calling thread)."""
        with self._lock:
            if flush:
                self._publish()
            yield

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
        """Sends the first `count` queued items (all: None); hold `_lock`."""
        queue = self._queue
        while queue and (count is None or count > 0):
            request_id, item = queue[0]
            try:
                # Made and sent in one hold of the GIL: a `time.sleep(0)` between the two
                # halves cost this thread ~30 of its ~130 us a chunk here and did not lower the
                # engine's stall (docs/benchmarks.md, session 29): each hand-off of the GIL
                # costs the thread that waits for it a wake-up.
                peer, header, src_block_ids = self.prepare(item)
                self.transport.send(peer, header, src_block_ids)
            except Exception as exc:  # (a bug too: the request fails, the thread goes on)
                if not isinstance(exc, TransferError):
                    log.exception("sending a chunk of %s failed", request_id)
                self._failed.append((request_id, f"could not send the pages: {exc}"))
            queue.popleft()
            count = None if count is None else count - 1

    def _run(self) -> None:
        low, poll_s, high = POLL_S
        last = 0.0  # when this thread last found a chunk queued (it times the stream's pace:
        # the engine's thread stamps nothing)
        while not self._closed:
            if self._queue:
                now = time.monotonic()
                if 0 < now - last < STREAM_GAP_S:
                    poll_s = min(max((now - last) / 4, low), high)
                last = now
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
