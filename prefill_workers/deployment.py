"""The prefill actor group: a Ray Serve deployment whose replicas each run a `PrefillService`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from tandem.engine.rpc import Handler
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_deployment import WorkerDeployment
from tandem.engine.worker_loop import WorkerLoop
from tandem.kv_transfer.receiver import ReservationGrant
from tandem.prefill_workers.prefill_service import PrefillService


@serve.deployment(name="prefill", max_ongoing_requests=512, health_check_period_s=5)
class PrefillWorker(WorkerDeployment):
    """RPC `prefill`: chunked prefill, pages streamed to the reserving decode worker."""

    service: PrefillService

    def make_service(self, engine: Any, transport: Any, on_stats: Any) -> WorkerLoop:
        cfg = self.settings
        return PrefillService(
            engine,
            transport,
            ack_timeout_s=cfg.ack_timeout_s,
            checksums=cfg.checksums,
            name=self.worker_id,
            on_stats=on_stats,
        )

    def rpc_handlers(self) -> dict[str, Handler]:
        return {
            "prefill": self._rpc_prefill,
            "kv_events": self._rpc_kv_events,
            "stats": self._rpc_stats,
        }

    async def _rpc_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        grant: dict[str, Any],
        priority: int = 0,
    ) -> AsyncIterator[dict[str, Any]]:
        """One item: the outcome (sent | failed | cancelled, first token ids, timings)."""
        yield await self.service.prefill(
            request_id,
            prompt_token_ids,
            SamplingParams(**params),
            ReservationGrant(**grant),
            priority,
        )
