"""Requests that end on the prefill worker. One that asks for a single token (max_tokens=1)
needs no decode worker: the router sends it to a prefill worker alone, with no reservation on
decode and no pages sent. Its prefill runs like any other here (continuous batching, chunked
prefill, the prefix cache); its token comes back as decode would have streamed it, as the
call's outcome (status "finished", the token item under "item")."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.engine_stats import scheduling_stages
from tandem.engine.outputs import StepOutput
from tandem.engine.request import Request


@dataclass
class FinishingHere:
    """One such request: its engine request and what its steps produced so far."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[dict[str, Any]]
    request: Request
    started: float = field(default_factory=time.time)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Any] | None = None

    def add(self, output: StepOutput) -> dict[str, Any] | None:
        """Takes one step's output; returns the call's outcome once the request finished."""
        self.token_ids += output.new_token_ids
        self.text += output.text_delta
        if output.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *output.logprobs]
        return self.outcome(output.finish_reason) if output.finished else None

    def outcome(self, finish_reason: str | None) -> dict[str, Any]:
        req = self.request
        stages = scheduling_stages(req)
        timings = {
            **stages,
            "prefill_s": max(0.0, time.time() - self.started - sum(stages.values())),
        }
        item: dict[str, Any] = {
            "type": "tokens",
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": finish_reason,
            "stop_reason": req.stop_reason,
            "num_cached_tokens": req.num_prefix_hit_tokens,
            "num_transferred_blocks": 0,
            "local_prefill": False,
            "timings": timings,
        }
        if self.logprobs is not None:
            item["logprobs"] = self.logprobs
        if req.prompt_logprobs is not None:
            item["prompt_logprobs"] = list(req.prompt_logprobs)
        return {
            "status": "finished",
            "first_token_ids": list(self.token_ids),
            "error": None,
            "timings": timings,
            "item": item,
        }
