"""Autoscaling by role (DESIGN §8): how many prefill / decode replicas the load asks for.

Ray Serve calls a deployment's custom policy on every controller tick with an
`AutoscalingContext`; `RoleAutoscalingPolicy` is that policy for tandem's workers (Ray 2.60:
`AutoscalingConfig(policy=AutoscalingPolicy(policy_function=..., policy_kwargs=...))`, a class
is instantiated once with the kwargs). It is a thin adapter over pure functions:

- `signals_from_metrics`: the replicas' custom metrics (what each worker returns from
  `record_autoscaling_stats`, averaged by Serve over `look_back_period_s`) -> `ReplicaSignals`.
- `desired_replicas`: signals + targets -> replicas the load asks for now, and why.
  Capacity signals (queued prefill tokens, KV usage, running sequences) ask for
  ceil(total / per-replica target); latency signals (TTFT for prefill, ITL for decode) ask for
  one replica more than are running when over target, and allow a scale-down only when the
  latency projected on one replica fewer stays under target.
- `apply_delays`: hysteresis. A scale-up happens once the load has asked for it for
  `upscale_delay_s` without a break, a scale-down (one replica at a time) after
  `downscale_delay_s`; any tick that disagrees restarts the clock, so the count cannot flap.

Serve's own `upscale_delay_s` / `downscale_delay_s` are set to 0 by `tandem.deploy.app_builder`
(Serve would otherwise apply its delays on top of these). The module imports nothing from
tandem or Ray at run time: Serve pickles it by value into its controller.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

logger = logging.getLogger("ray.serve")

Role = Literal["prefill", "decode"]
TOLERANCE = 0.1  # a capacity total within 10% of a replica's target does not ask for another
STATE_KEY = "tandem_autoscaling"  # our entry in Serve's per-deployment policy_state


@dataclass(frozen=True)
class ReplicaSignals:
    """One replica's recent load (the metric names its worker reports)."""

    queued_prefill_tokens: float = 0.0  # prompt tokens waiting to be prefilled
    ttft_ms: float = 0.0  # observed: a prefill's arrival to its first token, recent mean
    predicted_ttft_ms: float = 0.0  # queued tokens / measured prefill throughput
    kv_usage: float = 0.0  # fraction of the KV pool in use (0..1)
    running_seqs: float = 0.0  # sequences the replica is serving (reserved or decoding)
    itl_ms: float = 0.0  # observed inter-token latency, recent mean


METRIC_NAMES = tuple(f.name for f in fields(ReplicaSignals))


@dataclass(frozen=True)
class ScalingTargets:
    """What one role scales on; None turns a signal off. Per-replica targets for capacity."""

    role: Role
    min_replicas: int
    max_replicas: int
    upscale_delay_s: float
    downscale_delay_s: float
    queued_prefill_tokens: float | None = None
    ttft_ms: float | None = None
    kv_usage: float | None = None
    running_seqs: float | None = None
    itl_ms: float | None = None


@dataclass
class DelayState:
    """When the load started asking for more (or fewer) replicas, without a break."""

    up_since: float | None = None
    down_since: float | None = None

    @classmethod
    def load(cls, policy_state: dict[str, Any]) -> DelayState:
        saved = policy_state.get(STATE_KEY) or {}
        return cls(saved.get("up_since"), saved.get("down_since"))

    def dump(self) -> dict[str, Any]:
        return {"up_since": self.up_since, "down_since": self.down_since}


HOLD_MARK = "one replica fewer would miss the target"
HELD_KEY = "tandem_held"
"""In the policy state: whether the last tick held replicas for a latency target (logged once)."""


def signals_from_metrics(aggregated: dict[str, dict[Any, float]]) -> list[ReplicaSignals]:
    """Serve's `aggregated_metrics` (metric -> replica -> value) -> one `ReplicaSignals` per
    replica that reported (unknown metrics are ignored, missing ones are 0)."""
    per_replica: dict[Any, dict[str, float]] = {}
    for name, values in aggregated.items():
        if name in METRIC_NAMES:
            for replica, value in values.items():
                per_replica.setdefault(replica, {})[name] = float(value)
    return [ReplicaSignals(**values) for values in per_replica.values()]


def _capacity(total: float, per_replica: float) -> int:
    return max(0, math.ceil(total / per_replica - TOLERANCE))


def _latency(observed: float, target: float, running: int) -> int:
    """running + 1 when over target; running when one replica fewer would push it over;
    0 (no constraint) otherwise."""
    if observed > target * (1 + TOLERANCE):
        return running + 1
    if running > 1 and observed * running / (running - 1) > target:
        return running
    return 0


def desired_replicas(
    targets: ScalingTargets, signals: list[ReplicaSignals], running: int
) -> tuple[int, str]:
    """Replicas the load asks for now (clamped to min/max), and the signal that decided it."""
    running = max(running, 1)
    asks: list[tuple[int, str]] = []
    n = max(len(signals), 1)

    def total(name: str) -> float:
        return float(sum(getattr(s, name) for s in signals))

    for name in ("queued_prefill_tokens", "kv_usage", "running_seqs"):
        target = getattr(targets, name)
        if target is not None:
            value = total(name)
            asks.append(
                (_capacity(value, target), f"{name}={value:.3g} (target {target:g}/replica)")
            )
    latencies = (("ttft", targets.ttft_ms, max(total("ttft_ms"), total("predicted_ttft_ms")), 0),
                 ("itl", targets.itl_ms, total("itl_ms"), 1))  # fmt: skip
    for name, target_ms, value_sum, digits in latencies:
        if target_ms is not None:
            value = value_sum / n
            ask, reason = _latency(value, target_ms, running), f"{name}={value:.{digits}f}ms"
            if ask == running:  # (a hold: one replica fewer would miss the target)
                fewer = value * running / (running - 1)
                reason += f"; {HOLD_MARK} ({fewer:.{digits}f}ms > target {target_ms:g}ms)"
            asks.append((ask, reason))
    wanted, reason = max(asks, default=(targets.min_replicas, "no signal"), key=lambda a: a[0])
    clamped = min(max(wanted, targets.min_replicas), targets.max_replicas)
    return clamped, reason


def apply_delays(
    targets: ScalingTargets, desired: int, current: int, state: DelayState, now: float
) -> tuple[int, DelayState]:
    """The replica count to set now: `current` until the load has asked for `desired` long
    enough; down one replica at a time. `current` is Serve's target (not the running count)."""
    if desired > current:
        up_since = state.up_since if state.up_since is not None else now
        if now - up_since >= targets.upscale_delay_s:
            return desired, DelayState()
        return current, DelayState(up_since=up_since)
    if desired < current:
        down_since = state.down_since if state.down_since is not None else now
        if now - down_since >= targets.downscale_delay_s:
            return current - 1, DelayState()
        return current, DelayState(down_since=down_since)
    return current, DelayState()


class RoleAutoscalingPolicy:
    """The Serve policy (a class: Serve builds it once from `policy_kwargs`, the
    `ScalingTargets` fields, and calls it with each tick's `AutoscalingContext`)."""

    def __init__(self, **targets: Any) -> None:
        self.targets = ScalingTargets(**targets)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        signals = signals_from_metrics(ctx.aggregated_metrics or {})
        desired, reason = desired_replicas(self.targets, signals, ctx.current_num_replicas)
        current = int(ctx.target_num_replicas)
        decision, state = apply_delays(
            self.targets,
            desired,
            current,
            DelayState.load(ctx.policy_state),
            ctx.current_time if ctx.current_time is not None else time.time(),
        )
        held = decision == current and HOLD_MARK in reason and current > self.targets.min_replicas
        if held and not ctx.policy_state.get(HELD_KEY):  # (once per hold)
            logger.info(
                "tandem autoscaling: %s holds %d replicas (%s)", self.targets.role, current, reason
            )
        if decision != current:
            logger.info(
                "tandem autoscaling: %s %d -> %d replicas (%s; %d running)",
                self.targets.role,
                current,
                decision,
                reason,
                ctx.current_num_replicas,
            )
        return decision, {**ctx.policy_state, STATE_KEY: state.dump(), HELD_KEY: held}
