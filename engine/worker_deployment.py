"""What the prefill and decode Serve deployments share: start-up, RPC endpoint, stats, health,
autoscaling signals and the drain.

A replica builds its engine and KV transport from `WorkerSettings`, runs its role's service on
a loop thread, serves the router over `tandem.engine.rpc` on the replica's event loop, and
reports its stats (with the RPC address) to the worker registry.

Autoscaling: Serve calls `record_autoscaling_stats` periodically; the role's signals (names of
`tandem.deploy.autoscaling.ReplicaSignals` fields) go to the controller's policy.

Drain: when Serve stops the replica it awaits `__del__` (Serve accepts an async one), which
reports the worker as draining (the router stops choosing it), refuses new work with a
retryable "draining" answer, waits for its work calls, engine requests and KV transfers to end
(at most `drain_timeout_s`; Serve's `graceful_shutdown_timeout_s` is set above it), leaves the
registry, then closes the RPC endpoint and the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.engine.rpc import Handler, RPCServer
from tandem.engine.serve_logging import use_serve_log_handlers
from tandem.engine.worker_drain import WorkTracker, drain
from tandem.engine.worker_loop import WorkerDeadError, WorkerLoop
from tandem.engine.worker_registry import get_registry, registry_died
from tandem.engine.worker_settings import WorkerSettings, create_engine_and_transport

logger = logging.getLogger("tandem.worker")

REGISTRY_CHECK_S = 5.0
"""How often a worker checks that the registry it reports to lives."""


class WorkerDeployment(ABC):
    """Base of `PrefillWorker` / `DecodeWorker` (the classes Serve deploys)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import ray
        from ray import serve

        use_serve_log_handlers()
        cfg = WorkerSettings.model_validate(settings)
        self.settings = cfg
        engine, transport = create_engine_and_transport(cfg, ray.util.get_node_ip_address())
        self.worker_id = f"{cfg.role}/{serve.get_replica_context().replica_id.unique_id}"
        self._registry = get_registry(cfg.registry_name) if cfg.registry_name else None
        if self._registry is not None and cfg.auth_token:  # (a redeploy without a token of
            self._registry.cluster_token.remote(cfg.auth_token)  # its own takes this one)
        self.work = WorkTracker()
        self._info = _model_info(engine)
        self._left = False  # no more registry reports once the worker departed
        self.rpc = RPCServer(self.rpc_handlers(), cfg.auth_token)
        loop = asyncio.get_running_loop()
        self.service = self.make_service(engine, transport, self._reporter(loop))
        self.service.start()
        loop.create_task(self._start_rpc())
        if cfg.registry_name:
            loop.create_task(self._keep_registry(cfg.registry_name))
        logger.info("%s: KV transport %s at %s", self.worker_id, cfg.transport, transport.address)

    @abstractmethod
    def make_service(self, engine: Any, transport: Any, on_stats: Any) -> WorkerLoop:
        """The role's service (not started)."""

    @abstractmethod
    def rpc_handlers(self) -> dict[str, Handler]:
        """Methods the router calls over RPC (async generators); work methods go through
        `tracked` so that the drain waits for them and a draining worker refuses them."""

    @abstractmethod
    def refusal(self) -> dict[str, Any]:
        """The one item a draining worker answers a new work call with (code "draining")."""

    @abstractmethod
    def autoscaling_signals(self, stats: dict[str, Any]) -> dict[str, float]:
        """This replica's autoscaling signals, from its stats now."""

    @abstractmethod
    def in_flight(self, stats: dict[str, Any]) -> dict[str, int]:
        """What the drain waits for, besides work calls (engine requests, KV transfers)."""

    def on_drain(self) -> None:  # noqa: B027 (a hook: most roles have nothing to do)
        """The drain starts (new work calls are refused from now on)."""

    def tracked(self, handler: Handler) -> Handler:
        return self.work.wrap(handler, self.refusal)

    async def _start_rpc(self) -> None:
        import ray

        address = await self.rpc.start(ray.util.get_node_ip_address())
        logger.info("%s: RPC endpoint at %s", self.worker_id, address)
        self._report(await self.service.get_stats())

    async def _keep_registry(self, name: str) -> None:
        """Every REGISTRY_CHECK_S, whether the registry lives: one dead for good is made anew
        (reports are fire and forget: no failure would say so) and told the token."""
        while not self._left:
            await asyncio.sleep(REGISTRY_CHECK_S)
            try:
                await self._registry.ping.remote()  # type: ignore[union-attr]
            except Exception as exc:
                if not registry_died(exc) or self._left:
                    continue  # (restarting: the next check sees it)
                logger.warning("%s: worker registry died: reporting to a new one", self.worker_id)
                self._registry = get_registry(name)
                if self.settings.auth_token:
                    self._registry.cluster_token.remote(self.settings.auth_token)

    def _reporter(self, loop: asyncio.AbstractEventLoop) -> Callable[[dict[str, Any]], None]:
        """What the service's thread reports its stats with: `_report` on the replica's event
        loop, so that the registry call (~1.5 ms of Python, cold, every 0.1 s under load)
        leaves the engine's steps alone."""

        def report_soon(stats: dict[str, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # (the loop closed: the replica is gone)
                loop.call_soon_threadsafe(self._report, stats)

        return report_soon

    def _report(self, stats: dict[str, Any]) -> Any:
        if self._registry is not None and self.rpc.address and not self._left:
            extra: dict[str, Any] = {"rpc_address": self.rpc.address}
            if self.work.draining:
                extra["draining"] = True
            return self._registry.report.remote(self.worker_id, {**stats, **extra})
        return None

    async def _rpc_stats(self) -> AsyncIterator[dict[str, Any]]:
        """One item: the worker's stats now (the registry's copy may lag by ~0.1 s)."""
        yield {**await self.service.get_stats(), "worker_id": self.worker_id}

    async def _rpc_info(self) -> AsyncIterator[dict[str, Any]]:
        """What the router validates and routes requests with (one item; the same from every
        worker of a cluster but `num_blocks`, this worker's KV pool)."""
        yield self._info

    async def _rpc_kv_events(self) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(self.service.kv_events()) as items:
            async for batch in items:
                yield batch

    def check_health(self) -> None:
        if not self.service.alive:
            raise RuntimeError(f"{self.worker_id}: engine loop stopped: {self.service.error!r}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Called by Serve (autoscaling deployments only); averaged over its look-back window.
        Nothing once the worker's loop has stopped (Serve asks until the replica is gone)."""
        try:
            return self.autoscaling_signals(await self.service.get_stats())
        except WorkerDeadError:
            return {}

    async def _in_flight_counts(self) -> dict[str, int]:
        try:
            stats = await self.service.get_stats()
        except WorkerDeadError:  # nothing left to wait for
            return {}
        return {"work calls": self.work.in_flight, **self.in_flight(stats)}

    async def __del__(self) -> None:
        """Serve awaits this when it stops the replica: drain, leave, close."""
        service = getattr(self, "service", None)
        if service is None:  # the constructor failed: nothing started
            return
        self.work.draining = True
        self.on_drain()
        try:
            announced = self._report(await self.service.get_stats())
            if announced is not None:
                await announced  # the router drops draining workers on its next refresh
        except Exception as exc:  # a dead engine loop or registry: drain what is left anyway
            logger.warning("%s could not announce its drain: %r", self.worker_id, exc)
        report = await drain(self.worker_id, self._in_flight_counts, self.settings.drain_timeout_s)
        self._left = True
        if self._registry is not None:
            summary = {
                "role": self.settings.role,
                "waited_for": report.waited_for,
                "left": report.left,
                "seconds": report.seconds,
            }
            try:
                await self._registry.depart.remote(self.worker_id, summary)
            except Exception as exc:  # e.g. a registry actor from an older tandem: no `depart`
                logger.warning("%s could not record its departure: %r", self.worker_id, exc)
                self._registry.remove.remote(self.worker_id)
        await self.rpc.close()
        service.close()


def _model_info(engine: Any) -> dict[str, Any]:
    return {
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.spec.vocab_size,
        "block_size": engine.config.block_size,
        "num_blocks": engine.block_manager.num_blocks,
        "namespace": engine.namespace.digest(),
        "root_hash": engine.namespace.root_hash(),
    }
