"""Prefill routing policies on crafted loads: baselines, cache affinity, the imbalance guard."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from tandem.router.routing_policy import (
    CacheAffinity,
    LeastLoaded,
    PowerOfTwoChoices,
    RoundRobin,
    RoutingConfig,
    WorkerLoad,
    make_policy,
)


def loads_of(*specs: tuple[str, int, int]) -> dict[str, WorkerLoad]:
    return {w: WorkerLoad(w, queued, in_flight) for w, queued, in_flight in specs}


IDLE4 = loads_of(("a", 0, 0), ("b", 0, 0), ("c", 0, 0), ("d", 0, 0))


def test_round_robin_cycles_in_order() -> None:
    rr = RoundRobin()
    assert [rr.choose(IDLE4) for _ in range(6)] == ["a", "b", "c", "d", "a", "b"]


def test_least_loaded_uses_tokens_then_in_flight_and_rotates_ties() -> None:
    ll = LeastLoaded()
    loads = loads_of(("a", 500, 0), ("b", 100, 3), ("c", 100, 1), ("d", 900, 0))
    assert ll.choose(loads, {"a": 50}) == "c"  # ignores matches
    picks = Counter(ll.choose(IDLE4) for _ in range(8))
    assert picks == Counter({"a": 2, "b": 2, "c": 2, "d": 2})


def test_power_of_two_never_picks_the_most_loaded() -> None:
    p2 = PowerOfTwoChoices(seed=1)
    loads = loads_of(("a", 10, 0), ("b", 20, 0), ("c", 30, 0))
    picks = Counter(p2.choose(loads) for _ in range(300))
    assert picks["c"] == 0 and picks["a"] > picks["b"] > 0
    assert PowerOfTwoChoices().choose(loads_of(("solo", 5, 5))) == "solo"


def test_power_of_two_is_reproducible() -> None:
    loads = loads_of(("a", 10, 0), ("b", 20, 0), ("c", 30, 0), ("d", 5, 0))
    first, second = PowerOfTwoChoices(seed=7), PowerOfTwoChoices(seed=7)
    assert [first.choose(loads) for _ in range(50)] == [second.choose(loads) for _ in range(50)]


def test_affinity_trades_matched_prefix_against_queued_tokens() -> None:
    # Default weights: 64 matched blocks are worth 1,024 tokens, a queued token 0.5.
    cfg = RoutingConfig(block_size=16)
    loads = loads_of(("a", 1800, 0), ("b", 0, 0), ("c", 3000, 0))
    assert CacheAffinity(cfg).choose(loads, {"a": 64}) == "a"  # 1024 - 900 > 0
    assert CacheAffinity(cfg).choose(loads, {"a": 50}) == "b"  # 800 - 900 < 0
    assert CacheAffinity(cfg).choose(loads, {"a": 64, "c": 100}) == "a"  # 124 > 1600 - 1500
    one = RoutingConfig(block_size=16, load_weight=1.0)
    assert CacheAffinity(one).choose(loads_of(("a", 900, 0), ("b", 0, 0)), {"a": 50}) == "b"
    assert CacheAffinity(cfg).choose(loads, {"a": 64, "c": 120}) == "c"  # 1920 - 1500 > 124
    assert CacheAffinity(cfg).choose(loads, {}) == "b"
    assert CacheAffinity(cfg).choose(loads, {"gone": 64}) == "b"  # not a candidate
    heavy_load = cfg.model_copy(update={"load_weight": 2.0})
    assert CacheAffinity(heavy_load).choose(loads, {"a": 64}) == "b"  # 1024 - 1800 < 0
    in_flight = loads_of(("a", 0, 4), ("b", 0, 0))
    per_request = cfg.model_copy(update={"in_flight_weight": 300.0})
    assert CacheAffinity(per_request).choose(in_flight, {"a": 64}) == "b"  # 1024 - 1200 < 0


def test_affinity_spreads_new_prefixes_to_the_least_recently_chosen() -> None:
    policy = CacheAffinity()
    picks = Counter(policy.choose(IDLE4) for _ in range(12))
    assert picks == Counter({"a": 3, "b": 3, "c": 3, "d": 3})


def test_guard_stops_a_popular_prefix_piling_onto_one_worker() -> None:
    cfg = RoutingConfig(guard_max_share=1.1, guard_slack=1.0, guard_half_life=64)
    policy = CacheAffinity(cfg)
    picks = Counter(policy.choose(IDLE4, {"a": 64}) for _ in range(400))
    assert 0.25 < picks["a"] / 400 <= 1.1 / 4 + 0.02  # near its fair share, not 100 %
    assert min(picks.values()) > 80
    assert policy.is_hot("a", IDLE4) or policy.recent_share("a") <= 1.1 / 4 + 0.02
    unguarded = CacheAffinity(cfg.model_copy(update={"guard_max_share": 1e9}))
    assert Counter(unguarded.choose(IDLE4, {"a": 64}) for _ in range(400)) == {"a": 400}


def test_guard_lets_a_balanced_affinity_through() -> None:
    policy = CacheAffinity()
    owners = ["a", "b", "c", "d"] * 100  # each worker owns one prefix, traffic is even
    assert all(policy.choose(IDLE4, {w: 64}) == w for w in owners)


def test_affinity_forgets_removed_workers() -> None:
    policy = CacheAffinity()
    for _ in range(10):
        policy.choose(IDLE4, {"a": 64})
    policy.remove_worker("a")
    assert policy.recent_share("a") == 0.0
    three = {w: load for w, load in IDLE4.items() if w != "a"}
    assert policy.choose(three, {"a": 64}) in three


def test_make_policy_and_config() -> None:
    assert isinstance(make_policy(RoutingConfig(policy="round_robin")), RoundRobin)
    assert isinstance(make_policy(RoutingConfig(policy="least_loaded")), LeastLoaded)
    assert isinstance(make_policy(RoutingConfig(policy="power_of_two")), PowerOfTwoChoices)
    affinity = make_policy(RoutingConfig())
    assert isinstance(affinity, CacheAffinity) and affinity.uses_prefix_match
    assert not RoundRobin.uses_prefix_match
    cfg = RoutingConfig.model_validate_json('{"policy": "power_of_two", "seed": 3}')
    assert cfg.policy == "power_of_two" and cfg.seed == 3
    with pytest.raises(ValidationError):
        RoutingConfig.model_validate({"policy": "random"})
    with pytest.raises(ValidationError):
        RoutingConfig(guard_max_share=0.9)
