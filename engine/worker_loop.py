"""An engine on its own thread, driven by commands from asyncio callers (prefill and decode roles).

The engine and the transfer protocol are single-threaded: only the loop thread touches them.
Callers (a Ray Serve replica's event loop) `submit` a function and await its result; the loop
runs commands between engine steps. Results and stream items go back with
`loop.call_soon_threadsafe`, so nothing on the caller's side ever blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from tandem.engine.block_manager import BlockManager
from tandem.engine.errors import StepFailedError
from tandem.engine.kv_event_publisher import KVEventPublisher

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.05  # how long an idle loop sleeps on its command queue
STATS_INTERVAL_S = 0.1  # at most this often, stats are reported when they changed
HEARTBEAT_S = 2.0  # unchanged stats are re-reported this often
KV_EVENTS_INTERVAL_S = 0.01  # prefix-cache events are batched over at most this long
MAX_STEP_FAILURES = 5  # this many failed steps within the window end the loop (worker dies)
STEP_FAILURE_WINDOW_S = 60.0


class WorkerDeadError(RuntimeError):
    """The worker's loop stopped after an internal error; the worker cannot serve requests."""


def resolve(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any = None
) -> None:
    """Sets `future`'s result from any thread (ignored if it was cancelled meanwhile, or its
    loop closed: nobody awaits it any more, and the loop thread must go on)."""

    def _set() -> None:
        if not future.done():
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    with contextlib.suppress(RuntimeError):  # ("Event loop is closed")
        loop.call_soon_threadsafe(_set)


class WorkerLoop(ABC):
    """Runs `run_once()` forever on a daemon thread; `submit` queues work onto that thread."""

    def __init__(self, name: str, on_stats: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.name = name
        self.on_stats = on_stats
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None
        self._last_stats: dict[str, Any] | None = None
        self._last_report = 0.0
        self._kv_source: BlockManager | None = None
        self.kv_publisher: KVEventPublisher | None = None
        self._kv_subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = []
        self._last_kv_batch = 0.0
        self._step_failures: list[float] = []
        self.num_step_failures = 0

    def publish_kv_events(self, block_manager: BlockManager, namespace: str) -> None:
        """Publishes `block_manager`'s prefix-cache events (it must record them) to subscribers."""
        self._kv_source = block_manager
        self.kv_publisher = KVEventPublisher(self.name, namespace)

    async def kv_events(self) -> AsyncGenerator[dict[str, Any], None]:
        """A snapshot of the cached block hashes, then every batch of changes, in order."""
        if self.kv_publisher is None:
            raise RuntimeError(f"{self.name} does not publish KV events")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        entry = (loop, queue)

        def subscribe() -> None:
            self._flush_kv_events(force=True)
            self._kv_subscribers.append(entry)
            self._broadcast_snapshot()

        try:
            await self.submit(subscribe)
            while True:
                yield await queue.get()
        finally:
            self.post(lambda: self._kv_subscribers.remove(entry))

    def _flush_kv_events(self, force: bool = False) -> None:
        if self.kv_publisher is None or self._kv_source is None:
            return
        self.kv_publisher.collect(self._kv_source.drain_events())
        now = time.monotonic()
        if not force and now - self._last_kv_batch < KV_EVENTS_INTERVAL_S:
            return
        self._last_kv_batch = now
        batch = self.kv_publisher.take_batch()
        if batch is not None:
            self._send_kv_batch(batch)

    def _broadcast_snapshot(self) -> None:
        assert self.kv_publisher is not None
        self._send_kv_batch(self.kv_publisher.snapshot())

    def _send_kv_batch(self, batch: dict[str, Any]) -> None:
        for loop, subscriber in self._kv_subscribers:
            loop.call_soon_threadsafe(subscriber.put_nowait, batch)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def close(self) -> None:
        """Stops the loop and releases what the service holds (subclasses extend it)."""
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Runs `fn()` on the loop thread; the returned future gets its result or exception."""
        if self.error is not None:
            raise WorkerDeadError(f"{self.name} stopped: {self.error!r}")
        if self._stop.is_set():  # (a command queued now would never run: its caller would hang)
            raise WorkerDeadError(f"{self.name} is stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                resolve(loop, future, fn())
            except Exception as exc:  # handed to the caller, not swallowed
                resolve(loop, future, exc)

        self._commands.put(command)
        return future

    def post(self, fn: Callable[[], object]) -> None:
        """Runs `fn()` on the loop thread, without a result (fire and forget)."""
        self._commands.put(fn)

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                try:
                    self.run_once()
                except StepFailedError as exc:
                    self._recover(exc)
                self._flush_kv_events()
                self._maybe_report()
        except BaseException as exc:
            self.error = exc
            logger.exception("%s loop died", self.name)
            self.on_death(exc)

    def _recover(self, exc: StepFailedError) -> None:
        """Fails the failed step's requests and serves on; raises (the loop dies) when steps
        keep failing (`MAX_STEP_FAILURES` within `STEP_FAILURE_WINDOW_S`: the model itself is
        broken) or the block accounting no longer holds afterwards."""
        now = time.monotonic()
        self._step_failures = [t for t in self._step_failures if now - t < STEP_FAILURE_WINDOW_S]
        self._step_failures.append(now)
        self.num_step_failures += 1
        if len(self._step_failures) >= MAX_STEP_FAILURES:
            raise RuntimeError(
                f"{len(self._step_failures)} engine steps failed within "
                f"{STEP_FAILURE_WINDOW_S:.0f} s; the last: {exc}"
            ) from exc
        logger.error(
            "%s: %s; failing its %d request(s): %s",
            self.name,
            exc,
            len(exc.request_ids),
            ", ".join(exc.request_ids),
            exc_info=exc.cause,
        )
        self.on_step_failed(exc)

    def on_step_failed(self, exc: StepFailedError) -> None:
        """Fails `exc.request_ids` (every one: their state is unknown), releasing what they
        hold, then checks the block accounting. By default the loop dies instead."""
        raise exc

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def wait_for_command(self, timeout: float = IDLE_WAIT_S) -> None:
        """Blocks the idle loop until a command arrives (or `timeout`), then runs commands.
        Prefix-cache events not published yet go first: what the last step cached (a finished
        turn's blocks) must reach the router before the conversation's next turn is routed,
        not after this wait."""
        self._flush_kv_events(force=True)
        try:
            command = self._commands.get(timeout=timeout)
        except queue.Empty:
            return
        command()
        self._run_commands()

    def _maybe_report(self) -> None:
        if self.on_stats is None:
            return
        now = time.monotonic()
        if now - self._last_report < STATS_INTERVAL_S:
            return
        stats = self.stats()
        if stats != self._last_stats or now - self._last_report > HEARTBEAT_S:
            self._last_stats, self._last_report = stats, now
            try:
                self.on_stats(stats)
            except Exception:  # reporting is best effort; serving goes on
                logger.exception("%s could not report its stats", self.name)

    @abstractmethod
    def run_once(self) -> None:
        """One iteration: run a step if there is work, otherwise wait briefly for some."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot (called on the loop thread)."""

    async def get_stats(self) -> dict[str, Any]:
        """`stats()`, taken on the loop thread, for asyncio callers."""
        return await self.submit(self.stats)

    @abstractmethod
    def on_death(self, exc: BaseException) -> None:
        """Fails whatever callers still wait on (called on the loop thread after an error)."""
