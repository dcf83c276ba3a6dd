"""Prefill-worker choice: cache affinity traded against load, and baselines (DESIGN §6; issue 5).

A policy sees the candidate workers' loads (`WorkerLoad`, kept up to date by the router) and, for
`CacheAffinity`, how many leading blocks of the request's hash chain each worker holds
(`PrefixIndex.match`). It returns one worker id. Policies are single-threaded, do no I/O, and cost
O(matched workers) in Python plus O(workers) in C per decision.

`CacheAffinity` scores a worker, in tokens, as

    hit_weight * matched_blocks * block_size - load_weight * queued_prefill_tokens
        - in_flight_weight * in_flight

i.e. the prefill work saved minus the prefill work queued ahead (a TTFT proxy). The default
`load_weight` is 0.5: a worker prefills a whole batch of queued chunks per step, so a queued token
delays a new request by less than a recomputed one costs (in the `bench/prefix_routing.py`
simulation, 1.0 sent a group's request away from its prefix behind a single queued prompt). It
picks the best of the matched workers, the least-loaded worker and the least recently chosen
worker (which wins ties, so new prefixes spread evenly over idle workers). The imbalance guard
keeps an exponentially decayed count of the requests it sent to each worker (half-life
`guard_half_life` decisions); a worker whose count exceeds `guard_max_share` times the fair share
plus `guard_slack` requests is *hot*: its matched blocks count for nothing until its share decays, so a popular
prefix spreads (and is replicated) over several workers instead of piling onto one. The router
calls `remove_worker` for workers that leave.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from itertools import chain
from operator import attrgetter, itemgetter
from typing import ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CacheAffinity",
    "LeastLoaded",
    "PowerOfTwoChoices",
    "RoundRobin",
    "RoutingConfig",
    "RoutingPolicy",
    "WorkerLoad",
    "make_policy",
]

PolicyName = Literal["round_robin", "least_loaded", "power_of_two", "cache_affinity"]


class WorkerLoad(NamedTuple):
    """What the router knows of one prefill worker's load.

    `queued_prefill_tokens`: prompt tokens routed to the worker and not yet prefilled, not
    counting the prefix hits the router expected. `in_flight`: requests routed and not done.
    """

    worker_id: str
    queued_prefill_tokens: int = 0
    in_flight: int = 0


_LOAD_KEY = attrgetter("queued_prefill_tokens", "in_flight")
_QUEUED = itemgetter(1)  # WorkerLoad.queued_prefill_tokens


class RoutingConfig(BaseModel):
    """Prefill routing settings (part of the cluster config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: PolicyName = "cache_affinity"
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    hit_weight: float = Field(1.0, ge=0, description="score per matched prefix token")
    load_weight: float = Field(0.5, ge=0, description="penalty per queued prefill token")
    in_flight_weight: float = Field(0.0, ge=0, description="penalty (tokens) per in-flight request")
    guard_max_share: float = Field(
        1.1, gt=1.0, description="a worker above this multiple of its fair share is hot"
    )
    guard_slack: float = Field(1.0, ge=0, description="requests allowed above the share limit")
    guard_half_life: float = Field(256.0, gt=0, description="decisions; decay of recent counts")
    pending_ttl_s: float = Field(
        0.0,
        ge=0,
        description="also match prefixes routed in the last this-many seconds and not yet "
        "published by the worker (raises hit rates at high arrival rates, costs decision "
        "time); 0 turns it off",
    )
    seed: int = 0


class RoutingPolicy(ABC):
    """Chooses a prefill worker for one request."""

    uses_prefix_match: ClassVar[bool] = False  # whether `choose` reads `matched`

    @abstractmethod
    def choose(
        self, loads: Mapping[str, WorkerLoad], matched: Mapping[str, int] | None = None
    ) -> str:
        """The chosen worker id, among `loads` (which must not be empty).

        `matched`: worker -> leading blocks of the request's chain it holds (absent means 0).
        """

    def remove_worker(self, worker_id: str) -> None:  # noqa: B027 - optional hook
        """Forget per-worker state of a worker that left."""


class RoundRobin(RoutingPolicy):
    """Each worker in turn, in the mapping's order."""

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, loads: Mapping[str, WorkerLoad], matched: Mapping[str, int] | None = None
    ) -> str:
        workers = list(loads)
        i = self._next % len(workers)
        self._next = i + 1
        return workers[i]


class LeastLoaded(RoutingPolicy):
    """Fewest queued prefill tokens, then fewest in-flight requests; ties rotate."""

    def __init__(self) -> None:
        self._tick = 0

    def choose(
        self, loads: Mapping[str, WorkerLoad], matched: Mapping[str, int] | None = None
    ) -> str:
        self._tick += 1
        return _least_loaded(loads, self._tick).worker_id


class PowerOfTwoChoices(RoutingPolicy):
    """The less loaded of two distinct workers drawn at random."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(
        self, loads: Mapping[str, WorkerLoad], matched: Mapping[str, int] | None = None
    ) -> str:
        values = list(loads.values())
        n = len(values)
        if n == 1:
            return values[0].worker_id
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        a, b = values[i], values[j + (j >= i)]
        return (a if _LOAD_KEY(a) <= _LOAD_KEY(b) else b).worker_id


class CacheAffinity(RoutingPolicy):
    """Matched prefix traded against load, with the imbalance guard (see the module docstring)."""

    uses_prefix_match = True

    def __init__(self, config: RoutingConfig | None = None) -> None:
        config = config or RoutingConfig()
        self._hit = config.hit_weight * config.block_size
        self._load = config.load_weight
        self._flight = config.in_flight_weight
        self._cost: Callable[[WorkerLoad], float] = _QUEUED  # in C when in_flight_weight is 0
        if self._flight:
            load_w, flight = self._load, self._flight
            self._cost = lambda w: load_w * w.queued_prefill_tokens + flight * w.in_flight
        self._max_share = config.guard_max_share
        self._slack = config.guard_slack
        self._growth = 2.0 ** (1.0 / config.guard_half_life)
        # Decayed counts are stored scaled by `_unit` (which grows instead of every count
        # shrinking): true count = stored / _unit.
        self._unit = 1.0
        self._recent: dict[str, float] = {}
        self._total = 0.0
        self._cold: str | None = None

    def recent_share(self, worker_id: str) -> float:
        """The worker's fraction of the recent (decayed) decisions."""
        return self._recent.get(worker_id, 0.0) / self._total if self._total else 0.0

    def is_hot(self, worker_id: str, loads: Mapping[str, WorkerLoad]) -> bool:
        """Whether the guard keeps affinity requests away from the worker right now."""
        return self._recent.get(worker_id, 0.0) > self._hot_limit(loads)

    def _hot_limit(self, loads: Mapping[str, WorkerLoad]) -> float:
        return self._max_share * self._total / len(loads) + self._slack * self._unit

    def choose(
        self, loads: Mapping[str, WorkerLoad], matched: Mapping[str, int] | None = None
    ) -> str:
        # Candidates: the least-loaded worker, the least recently chosen one (it wins ties, so
        # new prefixes spread evenly), and every matched worker that is not hot. A hot worker's
        # matched blocks count for nothing.
        hit, load_w, flight = self._hit, self._load, self._flight
        recent = self._recent
        limit = self._hot_limit(loads) if matched else 0.0
        matched = matched or {}
        best = min(loads.values(), key=self._cost)
        cold = loads.get(self._coldest(loads))
        best_id, best_score = "", float("-inf")
        for load in (best, cold) if cold is not None and cold is not best else (best,):
            worker_id = load.worker_id
            blocks = matched.get(worker_id, 0) if recent.get(worker_id, 0.0) <= limit else 0
            score = hit * blocks - load_w * load.queued_prefill_tokens - flight * load.in_flight
            if score >= best_score:
                best_id, best_score = worker_id, score
        for worker_id, blocks in matched.items():
            other = loads.get(worker_id)
            if other is None or recent.get(worker_id, 0.0) > limit:
                continue
            score = hit * blocks - load_w * other.queued_prefill_tokens - flight * other.in_flight
            if score > best_score:
                best_id, best_score = worker_id, score
        self._record(best_id)
        return best_id

    def remove_worker(self, worker_id: str) -> None:
        self._total -= self._recent.pop(worker_id, 0.0)
        if worker_id == self._cold:
            self._cold = None

    def _coldest(self, loads: Mapping[str, WorkerLoad]) -> str:
        """The worker with the fewest recent decisions; amortized O(1).

        It is recomputed (O(workers), in C) only after it was chosen, so about once per
        `num_workers` decisions. New workers are noticed when `loads` outgrows the known set,
        which holds as long as the router calls `remove_worker` for workers that leave.
        """
        recent = self._recent
        if len(loads) > len(recent):
            for worker_id in loads:
                recent.setdefault(worker_id, 0.0)
            self._cold = None
        if self._cold is None:
            self._cold = min(recent, key=recent.__getitem__)
        return self._cold

    def _record(self, worker_id: str) -> None:
        if worker_id == self._cold:
            self._cold = None
        self._unit *= self._growth
        unit = self._unit
        self._recent[worker_id] = self._recent.get(worker_id, 0.0) + unit
        self._total += unit
        if unit > 1e100:  # rescale before floats overflow: every count divided by `unit`
            self._recent = {w: c / unit for w, c in self._recent.items()}
            self._total /= unit
            self._unit = 1.0


def _least_loaded(loads: Mapping[str, WorkerLoad], tick: int) -> WorkerLoad:
    """Fewest queued tokens, then fewest in flight; the scan starts at a rotating offset."""
    values = list(loads.values())
    start = tick % len(values)
    return min(chain(values[start:], values[:start]), key=_LOAD_KEY)


def make_policy(config: RoutingConfig) -> RoutingPolicy:
    """The policy `config.policy` names, set up from `config`."""
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_loaded":
        return LeastLoaded()
    if config.policy == "power_of_two":
        return PowerOfTwoChoices(config.seed)
    return CacheAffinity(config)
