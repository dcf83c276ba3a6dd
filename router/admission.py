"""Admission control: refuse at arrival what cannot meet its deadline or would overfill a queue.

Predicted TTFT on a prefill worker = its queue (prompt tokens this router sent it that it has not
finished prefilling, plus this request's uncached tokens) / its measured prefill throughput +
the transfer of the uncached blocks + a fixed overhead, times a safety factor. A request whose
deadline (its `deadline_ms` field, else its tenant's default, else the cluster default) is below
the prediction is answered 429 with `Retry-After`, before any work is done; so is a request that
would push a worker's queue past `max_queued_prefill_tokens`.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from tandem.router.errors import APIError


class TenantPolicy(BaseModel):
    """Defaults for the requests whose `user` field names this tenant."""

    model_config = ConfigDict(extra="forbid")

    deadline_ms: float | None = Field(None, gt=0, description="TTFT deadline")
    priority: int = Field(0, description="lower runs earlier")


class AdmissionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_deadline_ms: float | None = Field(
        None, gt=0, description="TTFT deadline of requests that carry none (None: no deadline)"
    )
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    max_queued_prefill_tokens: int | None = Field(
        None,
        gt=0,
        description="cap of each prefill queue (a prefill worker's; a decode worker's for the "
        "prompts it prefills itself), in prompt tokens",
    )
    max_decode_tokens: int | None = Field(
        None,
        gt=0,
        description="cap of each decode worker's load: prompt + max_tokens of its requests",
    )
    default_prefill_tokens_per_s: float = Field(
        20000.0, gt=0, description="assumed until a worker has measured its own"
    )
    transfer_ms_per_block: float = Field(0.05, ge=0)
    overhead_ms: float = Field(10.0, ge=0, description="router + RPC hops + first decode step")
    safety_factor: float = Field(2.0, ge=1.0, description="headroom for noisy throughput")


class Admission:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config

    def deadline_ms(self, requested: float | None, user: str | None) -> float | None:
        if requested is not None:
            return requested
        tenant = self.config.tenants.get(user or "")
        if tenant is not None and tenant.deadline_ms is not None:
            return tenant.deadline_ms
        return self.config.default_deadline_ms

    def priority(self, requested: int | None, user: str | None) -> int:
        if requested is not None:
            return requested
        tenant = self.config.tenants.get(user or "")
        return tenant.priority if tenant is not None else 0

    def predicted_ttft_ms(
        self, queued_tokens: int, new_tokens: int, tokens_per_s: float | None, blocks: int
    ) -> float:
        rate = tokens_per_s or self.config.default_prefill_tokens_per_s
        cfg = self.config
        raw = (queued_tokens + new_tokens) / rate * 1000 + blocks * cfg.transfer_ms_per_block
        return (raw + cfg.overhead_ms) * cfg.safety_factor

    def check_decode(self, queued_tokens: int, new_tokens: int, own_tokens: int = 0) -> None:
        """429 when the decode worker's token load would pass `max_decode_tokens` (and holds
        other requests' tokens than the `own_tokens` of this request's other choices)."""
        cap = self.config.max_decode_tokens
        if cap is not None and queued_tokens > own_tokens and queued_tokens + new_tokens > cap:
            raise _too_many(
                f"the decode worker holds {queued_tokens} tokens of requests; this request's "
                f"{new_tokens} would exceed the cap of {cap}",
                "decode_queue_full",
                1.0,
            )

    def check(
        self,
        *,
        queued_tokens: int,
        new_tokens: int,
        tokens_per_s: float | None,
        blocks: int,
        deadline_ms: float | None,
        own_tokens: int = 0,
    ) -> float:
        """The predicted TTFT (ms); raises a 429 `APIError` when the request cannot be admitted.
        A queue past the cap refuses only where it holds other requests' tokens than the
        `own_tokens` of this request's other choices (a lone request larger than the cap runs
        when its turn comes)."""
        cap = self.config.max_queued_prefill_tokens
        predicted = self.predicted_ttft_ms(queued_tokens, new_tokens, tokens_per_s, blocks)
        if cap is not None and queued_tokens + new_tokens > cap and queued_tokens > own_tokens:
            wait_s = queued_tokens / (tokens_per_s or self.config.default_prefill_tokens_per_s)
            raise _too_many(
                f"the prefill queue holds {queued_tokens} tokens; this request's {new_tokens} "
                f"would exceed the cap of {cap}",
                "queue_full",
                wait_s,
            )
        if deadline_ms is not None and predicted > deadline_ms:
            raise _too_many(
                f"predicted time to first token {predicted:.3g} ms exceeds the deadline of "
                f"{deadline_ms:.3g} ms",
                "deadline_unmeetable",
                (predicted - deadline_ms) / 1000,
            )
        return predicted


def _too_many(message: str, code: str, wait_s: float) -> APIError:
    retry = str(max(1, math.ceil(wait_s)))
    return APIError(
        429, message, type="rate_limit_error", code=code, headers={"Retry-After": retry}
    )
