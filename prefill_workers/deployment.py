"""The prefill actor group: a Ray Serve deployment whose replicas each run a `PrefillService`."""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_registry import get_registry
from tandem.engine.worker_settings import WorkerSettings, create_engine_and_transport
from tandem.kv_transfer.receiver import ReservationGrant
from tandem.prefill_workers.prefill_service import PrefillService

logger = logging.getLogger("tandem.prefill")


@serve.deployment(name="prefill", max_ongoing_requests=512, health_check_period_s=5)
class PrefillWorker:
    """`prefill(...)` runs chunked prefill and streams the pages to the reserving decode worker."""

    def __init__(self, settings: dict[str, Any]) -> None:
        cfg = WorkerSettings.model_validate(settings)
        engine, transport = create_engine_and_transport(cfg)
        self.worker_id = f"prefill/{serve.get_replica_context().replica_id.unique_id}"
        registry = get_registry(cfg.registry_name) if cfg.registry_name else None
        self._registry = registry
        self.service = PrefillService(
            engine,
            transport,
            ack_timeout_s=cfg.ack_timeout_s,
            checksums=cfg.checksums,
            name=self.worker_id,
            on_stats=(lambda s: registry.report.remote(self.worker_id, s)) if registry else None,
        )
        self.service.start()
        logger.info(
            "%s ready at %s (%s transport)", self.worker_id, transport.address, cfg.transport
        )

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        grant: dict[str, Any],
    ) -> dict[str, Any]:
        return await self.service.prefill(
            request_id, prompt_token_ids, SamplingParams(**params), ReservationGrant(**grant)
        )

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
