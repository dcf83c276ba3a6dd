"""What the router writes down about a finished request: its stage timings (for metrics), how
it was routed, and its one log line."""

from __future__ import annotations

import logging
import time
from typing import Any

from tandem.router.prepared import Prepared
from tandem.router.request_timings import RequestTimings
from tandem.router.route_planner import RoutePlan

REQUEST_LOG = "tandem.router.requests"
logger = logging.getLogger(REQUEST_LOG)  # (the router's one log of requests)


def log_requests(on: bool) -> None:
    """Whether the request log writes (off: `router.log_requests` false, vLLM's
    --disable-log-requests); on, it writes at the level the router's logs have."""
    logger.setLevel(logging.NOTSET if on else logging.WARNING)


def stage_seconds(t: RequestTimings) -> dict[str, float]:
    """Seconds of each stage the request went through (those it did not are left out)."""
    worker = t.worker
    stages = (
        ("tokenize", _span(t.arrival, t.marks.get("tokenized"))),
        ("reserve", _span(t.marks.get("tokenized"), t.marks.get("reserved"))),
        ("queue", worker.get("queue_s")),
        ("prefix_lookup", worker.get("prefix_lookup_s")),
        ("prefill", worker.get("prefill_s")),
        ("transfer", worker.get("transfer_tail_s")),
        ("decode", worker.get("decode_s")),
    )
    return {stage: seconds for stage, seconds in stages if seconds is not None}


def routing_decision(plan: RoutePlan) -> str:
    """How the request was routed: prefilled on its decode worker, or on a prefill worker
    with or without a prefix-cache hit."""
    if plan.prefill is None:
        return "local_prefill"
    return "prefill_prefix_hit" if plan.prefill_hit_blocks > 0 else "prefill_miss"


def finished_fields(req: Prepared | None, t: RequestTimings, user: str | None) -> dict[str, Any]:
    """`RouterMetrics.finished`'s figures of a request that finished or was abandoned (an
    abort); `req` None: one that left before it was routed."""
    return {
        "user": user,
        "arrival": t.arrival,
        "first_token": t.marks.get("first_token"),
        "end": t.marks.get("finished", time.time()),
        "prompt_tokens": len(req.prompt_token_ids) if req is not None else 0,
        "output_tokens": req.completion_tokens if req is not None else 0,
        "finish_reason": (req.finish_reason if req is not None else None) or "abort",
        "stages_s": stage_seconds(t) if req is not None else {},
        "transferred_blocks": (
            req.num_transferred_blocks
            if req is not None and req.plan is not None and req.plan.prefill is not None
            else None
        ),
    }


def log_left_early(request_id: str, t: RequestTimings) -> None:
    """The log line of a request whose client left before it was routed."""
    logger.info(
        "request %s cancelled(client left before it was routed) %s", request_id, _stages_text(t)
    )


def _stages_text(t: RequestTimings) -> str:
    return " ".join(f"{k}={v:.1f}ms" for k, v in t.stages_ms().items())


def log_request(req: Prepared, outcome: str) -> None:
    stages = _stages_text(req.timings)
    logger.info(
        "request %s %s prompt=%d completion=%d cached=%d transferred_blocks=%d route=%s %s",
        req.request_id,
        outcome,
        len(req.prompt_token_ids),
        req.completion_tokens,
        req.num_cached_tokens,
        req.num_transferred_blocks,
        _route(req.plan),
        stages,
    )


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _route(plan: RoutePlan | None) -> str:
    if plan is None:
        return "-"
    prefill = plan.prefill
    route = "local" if prefill is None else f"{prefill.worker_id}(hit={plan.prefill_hit_blocks})"
    if plan.decode is None:  # one token: it ended on the prefill worker
        return route
    joint = "@" if prefill is None else "->"
    return f"{route}{joint}{plan.decode.worker_id}(hit={plan.decode_hit_blocks})"
