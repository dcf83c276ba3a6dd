"""The `autoscaling:` block of a role in the cluster config, and the Serve options it becomes.

Without the block a role runs a fixed `replicas`; with it, `replicas` is the initial count and
Serve scales the role between `min_replicas` and `max_replicas` with
`tandem.deploy.autoscaling.RoleAutoscalingPolicy` on the targets below.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

POLICY = "tandem.deploy.autoscaling:RoleAutoscalingPolicy"


class RoleAutoscaling(BaseModel):
    """What both roles share: bounds, delays, how often replicas report."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1, description="Fewest replicas (the router needs one).")
    max_replicas: int = Field(2, ge=1, description="Most replicas.")
    upscale_delay_s: float = Field(
        10.0, ge=0, description="The load must ask for more replicas this long, unbroken."
    )
    downscale_delay_s: float = Field(
        60.0, ge=0, description="The load must allow one replica fewer this long, unbroken."
    )
    metrics_interval_s: float = Field(
        2.0, gt=0, description="How often each replica pushes its load to the Serve controller."
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="Serve averages each replica's load over this window."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RoleAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must exceed "
                f"metrics_interval_s ({self.metrics_interval_s})"
            )
        if not any(v is not None for v in self.signal_targets().values()):
            raise ValueError("every scaling target is null: set at least one")
        return self

    def signal_targets(self) -> dict[str, float | None]:
        """`ScalingTargets` signal fields -> this role's targets."""
        raise NotImplementedError

    def serve_autoscaling_config(self, role: str, initial_replicas: int) -> Any:
        """Ray Serve's `AutoscalingConfig` with tandem's policy. Serve's own delays are 0: the
        policy applies these (Serve would add its delays on top)."""
        from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

        kwargs = {
            "role": role,
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            **self.signal_targets(),
        }
        with warnings.catch_warnings():  # Serve deprecates metrics_interval_s for an env var
            warnings.simplefilter("ignore", DeprecationWarning)
            return AutoscalingConfig(
                min_replicas=self.min_replicas,
                max_replicas=self.max_replicas,
                initial_replicas=initial_replicas,
                upscale_delay_s=0.0,
                downscale_delay_s=0.0,
                metrics_interval_s=self.metrics_interval_s,
                look_back_period_s=self.look_back_period_s,
                policy=AutoscalingPolicy(policy_function=POLICY, policy_kwargs=kwargs),
            )


class PrefillAutoscaling(RoleAutoscaling):
    """Prefill scales on queued prefill tokens and TTFT (observed, and predicted from the queue)."""

    queued_prefill_tokens_per_replica: float | None = Field(
        4096, gt=0, description="Prompt tokens waiting per replica before another is added."
    )
    ttft_target_ms: float | None = Field(
        2000, gt=0, description="Prefill latency (arrival to first token) to stay under."
    )

    def signal_targets(self) -> dict[str, float | None]:
        return {
            "queued_prefill_tokens": self.queued_prefill_tokens_per_replica,
            "ttft_ms": self.ttft_target_ms,
        }


class DecodeAutoscaling(RoleAutoscaling):
    """Decode scales on KV usage, running sequences and inter-token latency."""

    kv_usage_target: float | None = Field(
        0.7, gt=0, le=1, description="KV pool fraction in use per replica to stay under."
    )
    running_seqs_per_replica: float | None = Field(
        32, gt=0, description="Sequences served per replica before another is added."
    )
    itl_target_ms: float | None = Field(100, gt=0, description="Inter-token latency to stay under.")

    def signal_targets(self) -> dict[str, float | None]:
        return {
            "kv_usage": self.kv_usage_target,
            "running_seqs": self.running_seqs_per_replica,
            "itl_ms": self.itl_target_ms,
        }
