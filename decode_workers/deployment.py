"""The decode actor group: a Ray Serve deployment whose replicas each run a `DecodeService`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from tandem.decode_workers.decode_service import DecodeService
from tandem.engine.rpc import Handler
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_deployment import WorkerDeployment
from tandem.engine.worker_loop import WorkerLoop


@serve.deployment(name="decode", max_ongoing_requests=512, health_check_period_s=5)
class DecodeWorker(WorkerDeployment):
    """RPC `generate`: one stream per request, the reservation grant, then the tokens."""

    service: DecodeService

    def make_service(self, engine: Any, transport: Any, on_stats: Any) -> WorkerLoop:
        cfg = self.settings
        return DecodeService(
            engine,
            transport,
            lease_s=cfg.lease_s,
            stall_timeout_s=cfg.stall_timeout_s,
            name=self.worker_id,
            on_stats=on_stats,
        )

    def rpc_handlers(self) -> dict[str, Handler]:
        return {
            "generate": self.generate,
            "info": self._rpc_info,
            "kv_events": self._rpc_kv_events,
            "stats": self._rpc_stats,
        }

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        local_prefill: bool = False,
        priority: int = 0,
    ) -> AsyncIterator[dict[str, Any]]:
        async for item in self.service.generate(
            request_id, prompt_token_ids, SamplingParams(**params), local_prefill, priority
        ):
            yield item

    async def _rpc_info(self) -> AsyncIterator[dict[str, Any]]:
        """What the router validates and routes requests with (one item)."""
        engine = self.service.engine
        yield {
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.spec.vocab_size,
            "block_size": engine.config.block_size,
            "num_blocks": engine.block_manager.num_blocks,
            "namespace": engine.namespace.digest(),
            "root_hash": engine.namespace.root_hash(),
        }
