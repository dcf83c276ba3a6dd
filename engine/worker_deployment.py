"""What the prefill and decode Serve deployments share: start-up, RPC endpoint, stats, health.

A replica builds its engine and KV transport from `WorkerSettings`, runs its role's service on
a loop thread, serves the router over `tandem.engine.rpc` on the replica's event loop, and
reports its stats (with the RPC address) to the worker registry.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from tandem.engine.rpc import Handler, RPCServer
from tandem.engine.serve_logging import use_serve_log_handlers
from tandem.engine.worker_loop import WorkerLoop
from tandem.engine.worker_registry import get_registry
from tandem.engine.worker_settings import WorkerSettings, create_engine_and_transport

logger = logging.getLogger("tandem.worker")


class WorkerDeployment(ABC):
    """Base of `PrefillWorker` / `DecodeWorker` (the classes Serve deploys)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from ray import serve

        use_serve_log_handlers()
        cfg = WorkerSettings.model_validate(settings)
        self.settings = cfg
        engine, transport = create_engine_and_transport(cfg)
        self.worker_id = f"{cfg.role}/{serve.get_replica_context().replica_id.unique_id}"
        self._registry = get_registry(cfg.registry_name) if cfg.registry_name else None
        self.rpc = RPCServer(self.rpc_handlers(), cfg.auth_token)
        self.service = self.make_service(engine, transport, self._report)
        self.service.start()
        asyncio.get_running_loop().create_task(self._start_rpc())
        logger.info("%s: KV transport %s at %s", self.worker_id, cfg.transport, transport.address)

    @abstractmethod
    def make_service(self, engine: Any, transport: Any, on_stats: Any) -> WorkerLoop:
        """The role's service (not started)."""

    @abstractmethod
    def rpc_handlers(self) -> dict[str, Handler]:
        """Methods the router calls over RPC (async generators)."""

    async def _start_rpc(self) -> None:
        import ray

        address = await self.rpc.start(ray.util.get_node_ip_address())
        logger.info("%s: RPC endpoint at %s", self.worker_id, address)
        self._report(await self.service.get_stats())

    def _report(self, stats: dict[str, Any]) -> None:
        if self._registry is not None and self.rpc.address:
            self._registry.report.remote(self.worker_id, {**stats, "rpc_address": self.rpc.address})

    async def _rpc_stats(self) -> AsyncIterator[dict[str, Any]]:
        """One item: the worker's stats now (the registry's copy may lag by ~0.1 s)."""
        yield {**await self.service.get_stats(), "worker_id": self.worker_id}

    async def _rpc_kv_events(self) -> AsyncIterator[dict[str, Any]]:
        async for batch in self.service.kv_events():
            yield batch

    def check_health(self) -> None:
        if not self.service.alive:
            raise RuntimeError(f"{self.worker_id}: engine loop stopped: {self.service.error!r}")

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.close()
        registry = getattr(self, "_registry", None)
        if registry is not None:
            registry.remove.remote(self.worker_id)
