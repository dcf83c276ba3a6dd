"""The shared-prefix routing simulation behind `bench/prefix_routing.py`.

Each simulated prefill worker is a real `BlockManager` driven by the engine's real `Scheduler`
(prefix lookup, chunked prefill under a token budget, `cache_blocks`, LRU eviction); there is no
model: a scheduled chunk is simply credited. A request leaves its worker (its blocks are freed,
as after the KV transfer to decode) in the step its prefill completes. After every step each
worker's `drain_events()` becomes one `KVEventBatch`, sent through JSON to the router's
`PrefixIndex`, so the router routes on exactly what the workers published, one step late.

Time runs in scheduler steps. Arrivals: `rate` requests per step, in the order `order` gives:
"shuffle" (default) is a seeded random permutation of all prompts (the groups interleave at
random); "interleave" takes one prompt of each group in turn (g0, g1, ..., g31, g0, ...), which
makes round-robin over 4 workers perfectly sticky by accident (32 is a multiple of 4).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from tandem.engine.block_manager import BlockManager
from tandem.engine.cache_namespace import CacheNamespace
from tandem.engine.hashing import hash_full_blocks
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.router.pending_prefixes import PendingPrefixes, merge_matches
from tandem.router.prefix_index import KVEventBatch, PrefixIndex
from tandem.router.routing_policy import RoutingConfig, WorkerLoad, make_policy

NAMESPACE = CacheNamespace(
    model_revision="bench", tokenizer_digest="bench", rope_digest="bench", kv_dtype="bfloat16"
)


@dataclass(frozen=True)
class Workload:
    groups: int = 32
    prompts_per_group: int = 16
    system_tokens: int = 1024
    question_tokens: int = 64
    output_tokens: int = 64  # decoded on the decode side; not simulated on prefill workers
    block_size: int = 16
    workers: int = 4
    cache_fraction: float = 1 / 3  # of the prefix working set, per worker
    rate: float = 4.0  # arrivals per step
    max_batched_tokens: int = 2048
    order: str = "shuffle"
    seed: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.question_tokens

    @property
    def blocks_per_worker(self) -> int:
        working_set = self.groups * self.system_tokens // self.block_size
        return math.ceil(working_set * self.cache_fraction)

    @property
    def ideal_hit_rate(self) -> float:
        """Every group's system prompt computed once, then hit by the group's other prompts."""
        hits = (self.prompts_per_group - 1) * self.system_tokens
        return hits / (self.prompts_per_group * self.prompt_tokens)


def make_prompts(w: Workload) -> list[tuple[int, list[int]]]:
    """(group, token ids) in arrival order."""
    rng = random.Random(w.seed)
    systems = [[rng.randrange(1, 32000) for _ in range(w.system_tokens)] for _ in range(w.groups)]
    prompts = [
        (g, systems[g] + [rng.randrange(1, 32000) for _ in range(w.question_tokens)])
        for _ in range(w.prompts_per_group)
        for g in range(w.groups)
    ]  # already interleaved: g0, g1, ..., g31, g0, ...
    if w.order == "shuffle":
        rng.shuffle(prompts)
    elif w.order != "interleave":
        raise ValueError(f"unknown order {w.order!r}")
    return prompts


class SimWorker:
    """One prefill worker: a block manager, the engine's scheduler, an event sequence number."""

    def __init__(self, worker_id: str, w: Workload, root: int) -> None:
        self.worker_id = worker_id
        self.bm = BlockManager(w.blocks_per_worker, w.block_size, enable_kv_events=True)
        self.scheduler = Scheduler(
            self.bm, root, max_num_batched_tokens=w.max_batched_tokens, max_num_seqs=256
        )
        self.seq = 0
        self.expected_hit: dict[str, int] = {}  # request id -> tokens the router expected to hit
        self.done: list[Request] = []

    def step(self) -> None:
        sched = self.scheduler
        out = sched.schedule()
        sched.advance(out)
        for req, _ in out.scheduled:
            if req.num_computed_tokens >= req.num_tokens:  # prefill done: hand off, free blocks
                sched.remove(req)
                self.expected_hit.pop(req.request_id, None)
                self.done.append(req)

    def event_batch(self, namespace: str) -> str | None:
        """The step's KV events as the JSON a worker would send, or None if there are none."""
        events = self.bm.drain_events()
        if not events:
            return None
        batch = KVEventBatch.from_kv_events(self.worker_id, self.seq, namespace, events)
        self.seq += 1
        return batch.model_dump_json()

    def load(self) -> WorkerLoad:
        sched = self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        queued += sum(r.num_tokens - self.expected_hit.get(r.request_id, 0) for r in sched.waiting)
        return WorkerLoad(self.worker_id, queued, len(sched.running) + len(sched.waiting))


def simulate(
    policy: str,
    w: Workload,
    config: RoutingConfig | None = None,
    pending_ttl_steps: float | None = None,
) -> dict[str, Any]:
    """Route and prefill the whole workload under one policy; hit rate and balance.

    `pending_ttl_steps`: if set (and the policy reads prefix matches), the router also records
    each routed chain in a `PendingPrefixes` overlay whose clock counts steps, and routes on the
    per-worker max of the index's and the overlay's matches.
    """
    namespace = NAMESPACE.digest()
    root = NAMESPACE.root_hash()
    workers = {f"prefill-{i}": SimWorker(f"prefill-{i}", w, root) for i in range(w.workers)}
    index = PrefixIndex()
    steps = 0
    pending = None
    if pending_ttl_steps is not None and policy == "cache_affinity":
        pending = PendingPrefixes(pending_ttl_steps, clock=lambda: float(steps))
    base = config or RoutingConfig(block_size=w.block_size, seed=w.seed)
    router = make_policy(base.model_copy(update={"policy": policy}))
    params = SamplingParams(max_tokens=w.output_tokens, ignore_eos=True)
    prompts = make_prompts(w)
    routed = dict.fromkeys(workers, 0)
    expected_hits = 0
    next_arrival, credit = 0, 0.0
    while next_arrival < len(prompts) or any(
        x.scheduler.has_unfinished() for x in workers.values()
    ):
        loads = {wid: x.load() for wid, x in workers.items()}
        credit += w.rate
        while credit >= 1.0 and next_arrival < len(prompts):
            credit -= 1.0
            _, tokens = prompts[next_arrival]
            rid = f"r{next_arrival}"
            next_arrival += 1
            hashes = hash_full_blocks(root, tokens, w.block_size)
            matched = index.match(namespace, hashes) if router.uses_prefix_match else {}
            if pending is not None:
                matched = merge_matches(matched, pending.match(namespace, hashes))
            wid = router.choose(loads, matched)
            if pending is not None:
                pending.record(wid, namespace, hashes)
            hit = min(matched.get(wid, 0), (len(tokens) - 1) // w.block_size) * w.block_size
            expected_hits += hit
            load = loads[wid]
            loads[wid] = load._replace(
                queued_prefill_tokens=load.queued_prefill_tokens + len(tokens) - hit,
                in_flight=load.in_flight + 1,
            )
            routed[wid] += 1
            workers[wid].expected_hit[rid] = hit
            workers[wid].scheduler.add(Request(rid, tokens, params, frozenset()))
        for x in workers.values():
            x.step()
            wire = x.event_batch(namespace)
            if wire is not None and not index.apply(KVEventBatch.model_validate_json(wire)):
                raise RuntimeError(f"{x.worker_id}: event batch rejected")
        steps += 1
    done = [r for x in workers.values() for r in x.done]
    for r in done:  # router and engine hash alike
        if (
            r.block_hashes
            != hash_full_blocks(root, r.token_ids, w.block_size)[: len(r.block_hashes)]
        ):
            raise RuntimeError(f"{r.request_id}: router and scheduler hashes differ")
    hit_tokens = sum(r.num_prefix_hit_tokens for r in done)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    counts = list(routed.values())
    hit_rate = hit_tokens / prompt_tokens
    return {
        "policy": policy,
        "pending_ttl_steps": pending_ttl_steps if pending is not None else None,
        "hit_rate": round(hit_rate, 4),
        "of_ideal": round(hit_rate / w.ideal_hit_rate, 4),
        "expected_hit_rate": round(expected_hits / prompt_tokens, 4),
        "requests_per_worker": counts,
        "max_min": round(max(counts) / max(min(counts), 1), 3),
        "preemptions": sum(x.scheduler.num_preemptions for x in workers.values()),
        "steps": steps,
    }
