"""Engine figures the workers report: queue lengths, preemptions, a request's scheduling stages."""

from __future__ import annotations

from typing import Any

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import Request, RequestStatus

__all__ = ["engine_queue_stats", "scheduling_stages"]


def engine_queue_stats(engine: LLMEngine) -> dict[str, Any]:
    """Running and waiting requests (vLLM's gauges), preemptions and prefix-cache evictions so
    far, KV usage (0..1)."""
    scheduler = engine.scheduler
    return {
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        "num_preemptions": engine.num_preemptions,
        "kv_cache_usage": engine.block_manager.usage,
        "prefix_cache_evicted_blocks": engine.block_manager.prefix_cache_stats.evicted_blocks,
    }


def scheduling_stages(req: Request) -> dict[str, float]:
    """Seconds the request spent queued (arrival to its prefix lookup, or to its first
    scheduling without prefix caching) and in the prefix lookup itself."""
    ts = req.timestamps
    arrived = ts[RequestStatus.NEW]
    scheduled = ts.get(RequestStatus.PREFILLING)
    if scheduled is None:
        return {}
    lookup = ts.get(RequestStatus.PREFIX_LOOKUP, scheduled)
    return {"queue_s": max(0.0, lookup - arrived), "prefix_lookup_s": max(0.0, scheduled - lookup)}
