"""The decode actor group: a Ray Serve deployment whose replicas each run a `DecodeService`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from tandem.decode_workers.decode_service import DecodeService
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_registry import get_registry
from tandem.engine.worker_settings import WorkerSettings, create_engine_and_transport

logger = logging.getLogger("tandem.decode")


@serve.deployment(name="decode", max_ongoing_requests=512, health_check_period_s=5)
class DecodeWorker:
    """`generate(...)` is one streaming call per request: the reservation grant, then tokens."""

    def __init__(self, settings: dict[str, Any]) -> None:
        cfg = WorkerSettings.model_validate(settings)
        engine, transport = create_engine_and_transport(cfg)
        self.worker_id = f"decode/{serve.get_replica_context().replica_id.unique_id}"
        registry = get_registry(cfg.registry_name) if cfg.registry_name else None
        self._registry = registry
        self.service = DecodeService(
            engine,
            transport,
            lease_s=cfg.lease_s,
            stall_timeout_s=cfg.stall_timeout_s,
            name=self.worker_id,
            on_stats=(lambda s: registry.report.remote(self.worker_id, s)) if registry else None,
        )
        self.service.start()
        logger.info(
            "%s ready at %s (%s transport)", self.worker_id, transport.address, cfg.transport
        )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in self.service.generate(
            request_id, prompt_token_ids, SamplingParams(**params)
        ):
            yield item

    async def info(self) -> dict[str, Any]:
        """What the router validates requests against."""
        engine = self.service.engine
        return {
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.spec.vocab_size,
            "block_size": engine.config.block_size,
            "num_blocks": engine.block_manager.num_blocks,
        }

    async def cancel(self, request_id: str) -> bool:
        return await self.service.cancel(request_id)

    async def stats(self) -> dict[str, Any]:
        return {**await self.service.get_stats(), "worker_id": self.worker_id}

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
