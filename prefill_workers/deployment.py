"""The prefill actor group: a Ray Serve deployment whose replicas each run a `PrefillService`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from tandem.engine.guided import compile_ahead
from tandem.engine.recent_mean import RecentMean
from tandem.engine.rpc import Handler
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_deployment import WorkerDeployment
from tandem.engine.worker_drain import DRAINING
from tandem.engine.worker_loop import WorkerLoop
from tandem.kv_transfer.receiver import ReservationGrant
from tandem.prefill_workers.prefill_service import PrefillService

SIGNAL_WINDOW_S = 5.0  # observed TTFT is the mean over prefills that ended this recently


@serve.deployment(
    name="prefill",
    max_ongoing_requests=512,
    health_check_period_s=5,
    graceful_shutdown_wait_loop_s=0.5,  # work comes over RPC, not Serve: `__del__` drains it
)
class PrefillWorker(WorkerDeployment):
    """RPC `prefill`: chunked prefill, pages streamed to the reserving decode worker."""

    service: PrefillService

    def __init__(self, settings: dict[str, Any]) -> None:
        self.ttft_ms = RecentMean(SIGNAL_WINDOW_S)
        super().__init__(settings)

    def make_service(self, engine: Any, transport: Any, on_stats: Any) -> WorkerLoop:
        cfg = self.settings
        return PrefillService(
            engine,
            transport,
            ack_timeout_s=cfg.ack_timeout_s,
            checksums=cfg.checksums,
            hand_off=cfg.hand_off,
            name=self.worker_id,
            on_stats=on_stats,
        )

    def rpc_handlers(self) -> dict[str, Handler]:
        return {
            "prefill": self.tracked(self._rpc_prefill),
            "grant": self._rpc_grant,
            "info": self._rpc_info,
            "kv_events": self._rpc_kv_events,
            "stats": self._rpc_stats,
        }

    def refusal(self) -> dict[str, Any]:
        return {
            "status": "failed",
            "code": DRAINING,
            "first_token_ids": [],
            "error": f"{self.worker_id} is draining (shutting down): retry on another worker",
        }

    def autoscaling_signals(self, stats: dict[str, Any]) -> dict[str, float]:
        queued = float(stats.get("num_waiting_tokens") or 0)
        rate = float(stats.get("prefill_tokens_per_s") or 0)
        return {
            "queued_prefill_tokens": queued,
            "ttft_ms": self.ttft_ms.mean(),
            "predicted_ttft_ms": queued / rate * 1000 if rate > 0 else 0.0,
        }

    def in_flight(self, stats: dict[str, Any]) -> dict[str, int]:
        return {
            "requests": int(stats.get("num_requests", 0)),
            "transfers": int(stats.get("num_transfers", 0)),
        }

    async def _rpc_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        grant: dict[str, Any] | None = None,
        priority: int = 0,
        stream_first_token: bool = False,
        finish_here: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """The outcome (sent | failed | cancelled, first token ids, timings) as the last item;
        with `stream_first_token`, first {"type": "first_token", "token_ids", "text"} as soon
        as it is sampled (when it can be streamed from here). Without `grant`, prefill starts
        at once and the pages wait for a `grant` call with decode's reservation. With
        `finish_here` the request (one token) ends here: outcome "finished", its "item"."""
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        first: asyncio.Future[dict[str, Any] | None] | None = (
            loop.create_future() if stream_first_token else None
        )
        sampling = SamplingParams(**params)
        # (a `grant` call that comes meanwhile is kept for this one: `attach_grant`)
        await compile_ahead(self.service.engine.grammars, sampling)
        future = self.service.begin(  # queued now, before a `grant` call can arrive
            request_id,
            prompt_token_ids,
            sampling,
            ReservationGrant(**grant) if grant is not None else None,
            priority,
            first_token=first,
            finish_here=finish_here,
        )
        try:
            if first is not None:
                waiting: set[asyncio.Future[Any]] = {future, first}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if first.done() and (item := first.result()) is not None:
                    yield {"type": "first_token", **item}
            outcome = await asyncio.shield(future)
        finally:
            if not future.done():  # cancelled by the router: cancel the prefill too
                # Posted now, in this step: the router may start the request again at once
                # (same id, with decode's grant), and that call's start must come after this
                # cancel on the loop thread. (Posted from a task of its own, it came after.)
                self.service.cancel(request_id, future)
        if outcome["status"] in ("sent", "finished"):  # arrival to first token: prefill's TTFT
            tail = float(outcome.get("timings", {}).get("transfer_tail_s", 0.0))
            self.ttft_ms.add((time.monotonic() - start - tail) * 1000)
        yield outcome

    async def _rpc_grant(
        self, request_id: str, grant: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """Decode's reservation for a prefill started without one: {"ok"} or {"error"}."""
        try:
            await self.service.attach_grant(request_id, ReservationGrant(**grant))
        except (KeyError, ValueError) as exc:
            yield {"ok": False, "error": str(exc)}
            return
        yield {"ok": True}
