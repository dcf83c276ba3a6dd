"""The router's view of the workers: who is up (from the registry), an RPC client to each, and
the least-loaded pick per role.

Load is what this router has in flight on a worker, then what the worker last reported (queued
prefill tokens for prefill, KV usage for decode). A later issue adds cache affinity on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.rpc import RPCClient
from tandem.router.errors import unavailable

logger = logging.getLogger("tandem.router")

REFRESH_S = 0.5
STALE_S = 10.0  # a worker silent this long (no heartbeat) is dropped


@dataclass
class Worker:
    worker_id: str
    role: str
    client: RPCClient
    stats: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0

    def load(self) -> tuple[float, ...]:
        reported = self.stats.get(
            "num_waiting_tokens" if self.role == "prefill" else "kv_cache_usage", 0
        )
        return (self.in_flight, float(reported or 0))


class WorkerDirectory:
    def __init__(self, registry: Any, auth_token: str) -> None:
        self.registry = registry
        self.auth_token = auth_token
        self.workers: dict[str, Worker] = {}
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # the registry may be restarting; keep the last view
                logger.warning("worker registry unavailable: %r", exc)
            await asyncio.sleep(REFRESH_S)

    async def refresh(self) -> None:
        entries = await self.registry.list.remote(STALE_S)
        seen = set()
        for entry in entries:
            address = entry.get("rpc_address")
            if not address:
                continue
            wid = str(entry["worker_id"])
            seen.add(wid)
            worker = self.workers.get(wid)
            if worker is None or worker.client.address != address or worker.client.closed:
                if worker is not None:
                    await worker.client.close()
                worker = Worker(wid, str(entry["role"]), RPCClient(address, self.auth_token))
                worker.in_flight = self.workers[wid].in_flight if wid in self.workers else 0
                self.workers[wid] = worker
                logger.info("router: %s worker %s at %s", worker.role, wid, address)
            worker.stats = entry
        for wid in set(self.workers) - seen:
            logger.info("router: worker %s left", wid)
            await self.workers.pop(wid).client.close()
        self._changed.set()
        self._changed = asyncio.Event()

    async def pick(self, role: str, timeout: float = 30.0) -> Worker:
        """The least-loaded live worker of `role`, waiting up to `timeout` for one to appear."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            candidates = [
                w for w in self.workers.values() if w.role == role and not w.client.closed
            ]
            if candidates:
                return min(candidates, key=Worker.load)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise unavailable(f"no {role} worker is available", f"no_{role}_worker")
            if self._task is None:
                await self.refresh()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)

    @contextlib.contextmanager
    def busy(self, worker: Worker) -> Iterator[None]:
        worker.in_flight += 1
        try:
            yield
        finally:
            worker.in_flight -= 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for worker in self.workers.values():
            await worker.client.close()
