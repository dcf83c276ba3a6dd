"""The router's view of the workers: who is up (from the registry), an RPC client to each, what
each caches (a `PrefixIndex` fed by their KV-event streams) and how loaded each is.

Load that matters for routing is what this router has routed and not seen finish: in-flight
requests, and queued prefill tokens (uncached prompt tokens sent to a prefill worker and not yet
prefilled). Workers' own reports (KV usage, measured prefill throughput) come with the registry.

A worker that reports itself draining (Serve is stopping it), or that refused work as draining,
is no longer chosen; its connection stays open for the requests it still serves, and is closed
once it left the registry and none of this router's requests use it. A worker that stops
reporting without draining while requests of this router run on it hangs (a dead one's
connection breaks): its connection is given up, and its requests go on elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.rpc import RPCClient, RPCError
from tandem.engine.worker_registry import registry_died
from tandem.router.errors import unavailable
from tandem.router.prefix_index import KVEventBatch, PrefixIndex

logger = logging.getLogger("tandem.router")

REFRESH_S = 0.5
STALE_S = 10.0  # a worker silent this long (no heartbeat) is dropped
REFUSING_S = 5.0  # how long a decode worker's refusal for want of room makes reserving serial


WORKER_WAIT_S = 60.0
"""How long a request waits for a worker of a role that has none live (a rolling update whose
old workers all drain before the new ones are up; a new replica took 28-39 s to start on a
slow 2-core host, past the 30 s this was)."""


@dataclass
class Worker:
    worker_id: str
    role: str
    client: RPCClient
    stats: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0
    queued_tokens: int = 0
    queued_prefill_tokens: int = 0
    """A decode worker's: the prompt tokens of the prefills it runs itself (colocated mode, a
    short uncached tail) not done yet, its prefill queue for admission control."""
    events_task: asyncio.Task[None] | None = None
    draining: bool = False
    lost_report: Any = None  # its registry report when its connection was seen lost
    refused_at: float | None = None
    """When (`time.monotonic()`) this decode worker last refused a reservation for want of KV
    room; cleared by its next reservation that succeeds."""

    def note_reservation(self, *, refused: bool) -> None:
        self.refused_at = time.monotonic() if refused else None

    def refusing(self) -> bool:
        """It refused a reservation within `REFUSING_S` and granted none since: a request for
        it reserves before its prefill starts, so a refusal wastes no prefill work."""
        return self.refused_at is not None and time.monotonic() - self.refused_at < REFUSING_S

    @property
    def kv_address(self) -> str | None:
        """Its KV transport's address (from its reports), where it has reported one."""
        address = self.stats.get("address")
        return address if isinstance(address, str) and address else None

    def load(self) -> tuple[float, ...]:
        reported = self.stats.get(
            "num_waiting_tokens" if self.role == "prefill" else "kv_cache_usage", 0
        )
        return (self.in_flight, self.queued_tokens, float(reported or 0))


def _lost_since_its_report(worker: Worker, address: str, entry: dict[str, Any]) -> bool:
    """The connection to `worker` broke or was refused, and the worker has not reported to the
    registry since this directory first saw that: it died (or hangs), and reconnecting would
    only fail again. Reports are compared by value, not against this machine's clock (the
    registry may run on another node). The first call after the loss records that report."""
    if worker.client.address != address or worker.client.lost_at is None:
        return False
    report = entry.get("reported_at")
    if worker.lost_report is None:
        worker.lost_report = report
        return True
    return bool(report == worker.lost_report)


_RESYNC_WHY = {
    "gap": "a gap in their sequence",
    "digest": "the worker's count and digest of its hashes differ from the index's copy",
}


class WorkerDirectory:
    def __init__(
        self, registry: Any, auth_token: str, reconnect: Callable[[], Any] | None = None
    ) -> None:
        """`reconnect`: a new registry actor, for when this one died for good."""
        self.registry = registry
        self.reconnect = reconnect
        self.auth_token = auth_token
        self.workers: dict[str, Worker] = {}
        self.index = PrefixIndex()
        self.on_worker_removed: list[Any] = []
        # (role, reason) of each resubscription to a worker's KV events: "gap" in the sequence,
        # or "digest" (its count and XOR of its hashes differed from the index's copy)
        self.on_kv_resync: list[Callable[[str, str], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._retiring: list[Worker] = []  # left the registry, still serving our requests
        self._stopping = False  # (`stop_waiting`)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        failing = False
        while True:
            try:
                await self.refresh()
                if failing:
                    logger.info("worker registry answers again")
                failing = False
            except Exception as exc:  # the registry may be restarting; keep the last view
                if not failing:
                    logger.warning("worker registry unavailable: %r", exc)
                failing = True
                if self.reconnect is not None and registry_died(exc):
                    logger.warning("worker registry died: a new one takes the workers' reports")
                    self.registry = self.reconnect()
            await asyncio.sleep(REFRESH_S)

    async def refresh(self) -> None:
        entries = await self.registry.list.remote(STALE_S)
        seen = set()
        for entry in entries:
            address = entry.get("rpc_address")
            if not address:
                continue
            wid = str(entry["worker_id"])
            worker = self.workers.get(wid)
            if entry.get("draining"):
                if worker is not None:  # keep serving its requests; choose it no more
                    seen.add(wid)
                    worker.stats = entry
                    self.mark_draining(wid)
                continue
            seen.add(wid)
            if worker is not None and _lost_since_its_report(worker, address, entry):
                worker.stats = entry  # dead until it reports again (or its entry ages out)
                continue
            if worker is None or worker.client.address != address or worker.client.closed:
                old = worker
                worker = Worker(wid, str(entry["role"]), RPCClient(address, self.auth_token))
                if old is not None:  # (its requests' plans give their load back to `old`)
                    await self._stop(old)
                self.workers[wid] = worker
                worker.events_task = asyncio.get_running_loop().create_task(
                    self._follow_kv_events(worker)
                )
                logger.info("router: %s worker %s at %s", worker.role, wid, address)
            worker.stats = entry
        for wid in set(self.workers) - seen:
            gone = self.workers.pop(wid)
            if gone.in_flight > 0 and not gone.draining and not gone.client.closed:
                # No report for STALE_S, not draining, our requests on it: it hangs (a dead
                # one's connection breaks). They go on elsewhere, as from a dead worker.
                logger.warning(
                    "router: worker %s stopped reporting with %d requests of this router in "
                    "flight: taking them to other workers",
                    wid,
                    gone.in_flight,
                )
                await gone.client.abandon(f"stopped answering (no report for {STALE_S:g} s)")
            else:
                logger.info("router: worker %s left", wid)
            self._retiring.append(gone)
            self.index.remove_worker(wid)
            for callback in self.on_worker_removed:
                callback(wid)
        for worker in [w for w in self._retiring if w.in_flight <= 0 or w.client.closed]:
            self._retiring.remove(worker)
            await self._stop(worker)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _follow_kv_events(self, worker: Worker) -> None:
        """Feeds the index; a gap in the sequence, or a worker's count and digest of its hashes
        that disagree with the index, re-subscribes (which starts with a snapshot)."""
        while not worker.client.closed:
            try:
                async with contextlib.aclosing(worker.client.stream("kv_events")) as items:
                    async for batch in items:
                        if self.index.apply(KVEventBatch.model_validate(batch)):
                            continue
                        reason = self.index.stale_reason(worker.worker_id)
                        if reason is None:
                            continue  # (a duplicate or an old snapshot: ignored)
                        logger.log(
                            logging.WARNING if reason == "digest" else logging.INFO,
                            "router: KV events of %s: %s; resyncing",
                            worker.worker_id,
                            _RESYNC_WHY.get(reason, reason),
                        )
                        for callback in self.on_kv_resync:
                            callback(worker.role, reason)
                        break
            except RPCError as exc:
                logger.info("router: KV events of %s stopped: %s", worker.worker_id, exc)
                self.index.mark_stale(worker.worker_id)
                await asyncio.sleep(REFRESH_S)

    async def _stop(self, worker: Worker) -> None:
        if worker.events_task is not None:
            worker.events_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker.events_task
        await worker.client.close()

    def live(self, role: str) -> list[Worker]:
        """The workers of `role` that can take new requests."""
        return [
            w
            for w in self.workers.values()
            if w.role == role and not w.client.closed and not w.draining
        ]

    def mark_draining(self, worker_id: str) -> None:
        """`worker_id` takes no new requests (it said so, or the registry did)."""
        worker = self.workers.get(worker_id)
        if worker is not None and not worker.draining:
            worker.draining = True
            logger.info("router: worker %s is draining", worker_id)

    async def live_stats(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Every live worker's stats, asked of the worker itself (not the registry's copy)."""

        async def one(worker: Worker) -> dict[str, Any]:
            try:
                stats = await asyncio.wait_for(worker.client.call("stats"), timeout)
            except (RPCError, OSError, TimeoutError) as exc:
                return {"worker_id": worker.worker_id, "role": worker.role, "error": str(exc)}
            return {**stats, "rpc_address": worker.client.address, "draining": worker.draining}

        workers = [w for w in self.workers.values() if not w.client.closed]
        return list(await asyncio.gather(*(one(w) for w in workers)))

    def stop_waiting(self) -> None:
        """The router is stopping: no worker is waited for from now on (a request that finds
        none fails at once with a 503 instead of holding the replica's stop until it times out)."""
        self._stopping = True
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, role: str, timeout: float = WORKER_WAIT_S) -> list[Worker]:
        """The live workers of `role`, waiting up to `timeout` for a first one to appear
        (not at all once `stop_waiting` was called)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            candidates = self.live(role)
            if candidates:
                return candidates
            remaining = deadline - loop.time()
            if remaining <= 0 or self._stopping:
                raise unavailable(f"no {role} worker is available", f"no_{role}_worker")
            if self._task is None:
                await self.refresh()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)

    async def pick(self, role: str, timeout: float = WORKER_WAIT_S) -> Worker:
        """The least-loaded live worker of `role`."""
        return min(await self.wait_for(role, timeout), key=Worker.load)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for worker in [*self.workers.values(), *self._retiring]:
            await self._stop(worker)
