"""Autoscaling by role without a cluster: the pure policy on synthetic contexts, its config, and
the Serve objects it becomes (built, pickled and called the way the Serve controller does)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.deploy.autoscaling import (
    ReplicaSignals,
    RoleAutoscalingPolicy,
    ScalingTargets,
    desired_replicas,
    signals_from_metrics,
)
from tandem.deploy.cluster_config import ClusterConfig

DECODE = {
    "role": "decode",
    "min_replicas": 1,
    "max_replicas": 3,
    "upscale_delay_s": 2.0,
    "downscale_delay_s": 5.0,
    "kv_usage": 0.7,
    "running_seqs": 4,
    "itl_ms": 100.0,
}
PREFILL = {
    "role": "prefill",
    "min_replicas": 1,
    "max_replicas": 4,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "queued_prefill_tokens": 1000,
    "ttft_ms": 500.0,
}


class Autoscaler:
    """Plays the Serve controller: one context per tick, policy state carried over, the target
    set to the policy's decision, running replicas catching up at once."""

    def __init__(self, targets: dict[str, Any], replicas: int = 1) -> None:
        self.policy = RoleAutoscalingPolicy(**targets)
        self.target = replicas
        self.state: dict[str, Any] = {}

    def tick(self, now: float, *replicas: dict[str, float]) -> int:
        """`replicas`: each running replica's metrics; returns the new target."""
        ctx = SimpleNamespace(
            aggregated_metrics=_metrics(replicas),
            current_num_replicas=len(replicas) or self.target,
            target_num_replicas=self.target,
            policy_state=self.state,
            current_time=now,
        )
        self.target, self.state = self.policy(ctx)
        return self.target


def _metrics(replicas: tuple[dict[str, float], ...]) -> dict[str, dict[Any, float]]:
    out: dict[str, dict[Any, float]] = {}
    for i, metrics in enumerate(replicas):
        for name, value in metrics.items():
            out.setdefault(name, {})[f"replica-{i}"] = value
    return out


def busy(seqs: float, itl_ms: float = 20.0, kv: float = 0.1) -> dict[str, float]:
    return {"running_seqs": seqs, "itl_ms": itl_ms, "kv_usage": kv}


IDLE = busy(0, itl_ms=0.0, kv=0.0)


def test_up_when_over_target_only_once_the_upscale_delay_passed() -> None:
    scaler = Autoscaler(DECODE)
    assert [scaler.tick(t, busy(10)) for t in (0.0, 1.0, 1.9)] == [1, 1, 1]
    assert scaler.tick(2.0, busy(10)) == 3  # 10 seqs / 4 per replica: 3 replicas at once


def test_a_break_in_the_load_restarts_the_upscale_clock() -> None:
    scaler = Autoscaler(DECODE)
    assert scaler.tick(0.0, busy(6)) == 1
    assert scaler.tick(1.5, busy(2)) == 1  # under target: the clock stops
    assert scaler.tick(2.5, busy(6)) == 1  # starts again here
    assert scaler.tick(4.0, busy(6)) == 1
    assert scaler.tick(4.5, busy(6)) == 2


def test_down_after_the_downscale_delay_one_replica_at_a_time() -> None:
    scaler = Autoscaler(DECODE, replicas=3)
    idle = (IDLE, IDLE, IDLE)
    assert [scaler.tick(t, *idle) for t in (0.0, 2.0, 4.9)] == [3, 3, 3]
    assert scaler.tick(5.0, *idle) == 2
    assert scaler.tick(6.0, IDLE, IDLE) == 2  # the clock restarts after a scale-down
    assert scaler.tick(10.9, IDLE, IDLE) == 2
    assert scaler.tick(11.0, IDLE, IDLE) == 1
    assert scaler.tick(100.0, IDLE) == 1  # never under min_replicas


def test_clamped_to_min_and_max() -> None:
    scaler = Autoscaler({**DECODE, "upscale_delay_s": 0.0})
    assert scaler.tick(0.0, busy(400)) == 3
    floor = Autoscaler({**DECODE, "min_replicas": 2, "downscale_delay_s": 0.0}, replicas=2)
    assert floor.tick(0.0, IDLE, IDLE) == 2


def test_a_load_that_crosses_the_target_back_and_forth_does_not_flap() -> None:
    scaler = Autoscaler(DECODE, replicas=2)
    decisions = set()
    for tick in range(120):  # every 0.5 s for a minute: above, below, above...
        seqs = 9.0 if tick % 4 < 2 else 2.0
        decisions.add(scaler.tick(tick * 0.5, busy(seqs / 2), busy(seqs / 2)))
    assert decisions == {2}


def test_latency_over_target_adds_a_replica_and_holds_a_scale_down() -> None:
    targets = ScalingTargets(**DECODE)  # type: ignore[arg-type]
    slow = ReplicaSignals(running_seqs=1, itl_ms=150.0)
    assert desired_replicas(targets, [slow], running=1)[0] == 2
    # capacity asks for 1 of 2, but ITL 80 ms on one replica fewer projects to 160 ms > 100
    warm = [ReplicaSignals(running_seqs=1, itl_ms=80.0)] * 2
    held = "itl=80.0ms; one replica fewer would miss the target (160.0ms > target 100ms)"
    assert desired_replicas(targets, warm, running=2) == (2, held)
    cool = [ReplicaSignals(running_seqs=1, itl_ms=30.0)] * 2
    assert desired_replicas(targets, cool, running=2)[0] == 1


def test_a_hold_for_latency_is_logged_once(caplog: Any) -> None:
    scaler = Autoscaler({**DECODE, "downscale_delay_s": 0.0}, replicas=2)
    with caplog.at_level("INFO", logger="ray.serve"):
        for tick in range(3):
            assert scaler.tick(float(tick), busy(1, itl_ms=80.0), busy(1, itl_ms=80.0)) == 2
        assert scaler.tick(3.0, busy(1, itl_ms=30.0), busy(1, itl_ms=30.0)) == 1
    holds = [r.getMessage() for r in caplog.records if "holds" in r.getMessage()]
    assert holds == [
        "tandem autoscaling: decode holds 2 replicas (itl=80.0ms; one replica fewer would miss "
        "the target (160.0ms > target 100ms))"
    ]


def test_a_replica_still_starting_is_not_added_again_for_latency() -> None:
    scaler = Autoscaler({**DECODE, "upscale_delay_s": 0.0})
    assert scaler.tick(0.0, busy(1, itl_ms=200.0)) == 2
    # the target is 2, one replica runs and is still slow: no third replica for that
    assert scaler.tick(1.0, busy(1, itl_ms=200.0)) == 2


def test_prefill_scales_on_queued_tokens_and_on_ttft() -> None:
    targets = ScalingTargets(**PREFILL)  # type: ignore[arg-type]
    queued = [ReplicaSignals(queued_prefill_tokens=2500)]
    assert desired_replicas(targets, queued, running=1)[0] == 3
    predicted = [ReplicaSignals(queued_prefill_tokens=900, predicted_ttft_ms=900)]
    assert desired_replicas(targets, predicted, running=1) == (2, "ttft=900ms")
    observed = [ReplicaSignals(ttft_ms=700)]
    assert desired_replicas(targets, observed, running=1)[0] == 2
    scaler = Autoscaler(PREFILL, replicas=2)
    idle = {"queued_prefill_tokens": 0.0, "ttft_ms": 0.0, "predicted_ttft_ms": 0.0}
    assert [scaler.tick(t, idle, idle) for t in (0.0, 3.0)] == [2, 1]


def test_within_tolerance_of_the_target_asks_for_no_more() -> None:
    targets = ScalingTargets(**DECODE)  # type: ignore[arg-type]
    assert desired_replicas(targets, [ReplicaSignals(running_seqs=4.3)], running=1)[0] == 1
    assert desired_replicas(targets, [ReplicaSignals(running_seqs=4.5)], running=1)[0] == 2


def test_metrics_of_serve_become_signals() -> None:
    signals = signals_from_metrics(
        {"running_seqs": {"a": 3, "b": 1}, "kv_usage": {"a": 0.5}, "ongoing_requests": {"a": 9}}
    )
    assert sorted(signals, key=lambda s: s.running_seqs) == [
        ReplicaSignals(running_seqs=1),
        ReplicaSignals(running_seqs=3, kv_usage=0.5),
    ]
    assert desired_replicas(ScalingTargets(**DECODE), [], running=1)[0] == 1  # type: ignore[arg-type]


# ---- the cluster config block and the Serve objects ------------------------------------------


def test_the_autoscaling_block_validates() -> None:
    cfg = ClusterConfig.model_validate(
        {
            "prefill": {"replicas": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 3}},
            "decode": {"autoscaling": {"itl_target_ms": 50, "kv_usage_target": None}},
        }
    )
    assert cfg.prefill.autoscaling is not None
    assert cfg.prefill.autoscaling.signal_targets() == {
        "queued_prefill_tokens": 4096,
        "ttft_ms": 2000,
    }
    assert cfg.decode.autoscaling is not None
    assert cfg.decode.autoscaling.signal_targets()["itl_ms"] == 50
    assert ClusterConfig().decode.autoscaling is None


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "above max"),
        ({"decode": {"replicas": 4, "autoscaling": {"max_replicas": 3}}}, "initial count"),
        ({"prefill": {"autoscaling": {"itl_target_ms": 50}}}, "itl_target_ms"),
        ({"decode": {"autoscaling": {"look_back_period_s": 1}}}, "look_back_period_s"),
        (
            {
                "decode": {
                    "autoscaling": {
                        "kv_usage_target": None,
                        "running_seqs_per_replica": None,
                        "itl_target_ms": None,
                    }
                }
            },
            "at least one",
        ),
    ],
)
def test_bad_autoscaling_blocks_are_refused_by_name(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ClusterConfig.model_validate(bad)


def test_the_example_config_shows_every_autoscaling_field() -> None:
    from pathlib import Path

    import yaml

    from tandem.deploy.autoscaling_config import DecodeAutoscaling, PrefillAutoscaling

    example = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.yaml"
    data = yaml.safe_load(example.read_text())
    for role, model in (("prefill", PrefillAutoscaling), ("decode", DecodeAutoscaling)):
        assert set(data[role]["autoscaling"]) == set(model.model_fields), role
        assert "drain_timeout_s" in data[role]
    cfg = ClusterConfig.model_validate(data)
    assert cfg.prefill.autoscaling is not None and cfg.decode.autoscaling is not None


def test_worker_options_hand_the_policy_to_serve_which_calls_it() -> None:
    pytest.importorskip("ray.serve")
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingContext

    from tandem.deploy.app_builder import worker_options

    cfg = ClusterConfig.model_validate(
        {
            "decode": {
                "drain_timeout_s": 12,
                "autoscaling": {"max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3},
            }
        }
    )
    options = worker_options(cfg.decode, "decode")
    assert options["graceful_shutdown_timeout_s"] > 12
    assert "num_replicas" not in options
    serve_cfg = options["autoscaling_config"]
    assert (serve_cfg.upscale_delay_s, serve_cfg.downscale_delay_s) == (0, 0)  # ours apply
    assert serve_cfg.policy.policy_kwargs["upscale_delay_s"] == 1
    # what the controller does: unpickle, build the class with its kwargs, wrap, call per tick
    policy_cls = serve_cfg.policy.get_policy()
    wrapped = _apply_autoscaling_config(policy_cls(**serve_cfg.policy.policy_kwargs))

    def context(now: float, target: int, state: dict[str, Any]) -> AutoscalingContext:
        return AutoscalingContext(
            deployment_id=None,  # type: ignore[arg-type]
            deployment_name="decode",
            app_name="tandem",
            current_num_replicas=target,
            target_num_replicas=target,
            running_replicas=[],
            total_num_requests=0.0,
            total_queued_requests=0.0,
            aggregated_metrics={"running_seqs": {"r1": 70.0}},
            raw_metrics={},
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=2,
            policy_state=state,
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=serve_cfg,
        )

    decision, state = wrapped(context(100.0, 1, {}))
    assert decision == 1
    decision, state = wrapped(context(101.0, 1, state))
    assert decision == 2
    fixed = worker_options(ClusterConfig().decode, "decode")
    assert fixed["num_replicas"] == 1 and "autoscaling_config" not in fixed
