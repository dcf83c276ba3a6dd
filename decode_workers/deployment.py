"""The decode actor group: a Ray Serve deployment whose replicas each run a `DecodeService`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from tandem.decode_workers.decode_service import DecodeService
from tandem.engine.recent_mean import RecentMean
from tandem.engine.rpc import Handler
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_deployment import WorkerDeployment
from tandem.engine.worker_drain import DRAINING
from tandem.engine.worker_loop import WorkerLoop

SIGNAL_WINDOW_S = 5.0  # observed ITL is the mean over tokens streamed this recently


@serve.deployment(
    name="decode",
    max_ongoing_requests=512,
    health_check_period_s=5,
    graceful_shutdown_wait_loop_s=0.5,  # work comes over RPC, not Serve: `__del__` drains it
)
class DecodeWorker(WorkerDeployment):
    """RPC `generate`: one stream per request, the reservation grant, then the tokens."""

    service: DecodeService

    def __init__(self, settings: dict[str, Any]) -> None:
        self.itl_ms = RecentMean(SIGNAL_WINDOW_S)
        super().__init__(settings)

    def make_service(self, engine: Any, transport: Any, on_stats: Any) -> WorkerLoop:
        cfg = self.settings
        return DecodeService(
            engine,
            transport,
            lease_s=cfg.lease_s,
            stall_timeout_s=cfg.stall_timeout_s,
            reserve_wait_s=cfg.reserve_wait_s,
            stream_interval=cfg.stream_interval,
            name=self.worker_id,
            on_stats=on_stats,
        )

    def rpc_handlers(self) -> dict[str, Handler]:
        return {
            "generate": self.tracked(self.generate),
            "info": self._rpc_info,
            "release_unwritten": self._rpc_release_unwritten,  # (frees: answered while draining)
            "release_from_lost_sender": self._rpc_release_from_lost_sender,  # (frees, too)
            "kv_events": self._rpc_kv_events,
            "stats": self._rpc_stats,
        }

    def refusal(self) -> dict[str, Any]:
        return {
            "type": "error",
            "code": DRAINING,
            "error": f"{self.worker_id} is draining (shutting down): retry on another worker",
        }

    def on_drain(self) -> None:
        self.service.post(self.service.refuse_waiting)  # (they move to another worker)

    def autoscaling_signals(self, stats: dict[str, Any]) -> dict[str, float]:
        return {
            "kv_usage": float(stats.get("kv_cache_usage") or 0),
            "running_seqs": float(self.work.in_flight),
            "itl_ms": self.itl_ms.mean(),
        }

    def in_flight(self, stats: dict[str, Any]) -> dict[str, int]:
        return {
            "requests": int(stats.get("num_requests", 0)),
            "streams": int(stats.get("num_streams", 0)),
            "transfers": int(stats.get("num_reservations", 0))
            + int(stats.get("num_held_reservations", 0)),
        }

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        local_prefill: bool = False,
        priority: int = 0,
        wait_for_room: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        last: float | None = None  # when the previous token item went out
        async with contextlib.aclosing(
            self.service.generate(
                request_id,
                prompt_token_ids,
                SamplingParams(**params),
                local_prefill,
                priority,
                wait_for_room=wait_for_room,
            )
        ) as items:
            async for item in items:
                if item["type"] == "tokens":
                    now = time.monotonic()
                    tokens = len(item["token_ids"])
                    if last is not None and tokens:
                        self.itl_ms.add((now - last) * 1000 / tokens, weight=tokens)
                    last = now
                yield item

    async def _rpc_release_unwritten(self, request_id: str) -> AsyncIterator[dict[str, Any]]:
        """The router never handed this request's grant to a prefill worker (one item)."""
        yield {"released_blocks": await self.service.release_unwritten(request_id)}

    async def _rpc_release_from_lost_sender(
        self, request_id: str, sender: str
    ) -> AsyncIterator[dict[str, Any]]:
        """The router lost the prefill worker it handed `request_id`'s grant to."""
        released = await self.service.release_from_lost_sender(request_id, sender)
        yield {"released_blocks": released}
