"""One thread that makes a sender's transport calls, in the order they were queued.

A prefill engine hands each chunk of pages to the transport between two forward passes. Right
after a pass every line of Python runs with cold caches (about 20x slower on a small VM), and a
`send` call (JSON of the header, checks, locks, waking the transport's own thread) then costs
~100 µs of the engine's time per chunk. `SendThread.post` only queues a closure; this thread
runs it while the engine computes the next chunk (torch releases the GIL in its kernels).

Order is kept: chunk sends, cancels and the transport's `cancel` of queued pages run exactly in
the order they were posted. A call that raises is reported through `failures()` with the
request it belonged to, for the sender's next `poll` to fail that request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class SendThread:
    def __init__(self, name: str = "kv-send") -> None:
        self._calls: queue.SimpleQueue[tuple[str | None, Callable[[], object]] | None] = (
            queue.SimpleQueue()
        )
        self._failures: queue.SimpleQueue[tuple[str | None, str]] = queue.SimpleQueue()
        self.cpu_s = 0.0
        """CPU time the calls took on this thread: an upper bound of how long they held the GIL
        (and so might have held up the engine's thread between two torch kernels)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, request_id: str | None, call: Callable[[], object]) -> None:
        """Runs `call()` on the thread after everything posted before it."""
        self._calls.put((request_id, call))

    def failures(self) -> list[tuple[str | None, str]]:
        """(request id, error) of calls that raised since the last look."""
        out = []
        while True:
            try:
                out.append(self._failures.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float = 5.0) -> None:
        """Runs what is queued, then stops the thread."""
        self._calls.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            request_id, call = item
            start = time.thread_time()
            try:
                call()
            except Exception as exc:  # reported to the sender, which fails the request
                logger.warning("kv send for %s failed: %r", request_id, exc)
                self._failures.put((request_id, f"{type(exc).__name__}: {exc}"))
            self.cpu_s += time.thread_time() - start
