"""Router decision speed for `bench/prefix_routing.py`: index match + cache-affinity choice.

Setup per worker count N: max(32, 8 N) prefix groups with 64-block (1,024-token) system prompts,
each held by one worker and a quarter of them also by a second one, plus a 4-block question tail
per held group, loaded into a `PrefixIndex` through `KVEventBatch`es. Requests: 4,096 pre-hashed
68-block chains (a random group's prefix plus a fresh question; one in ten from an unknown group).
Loads: random queued tokens (0..4,095) and in-flight counts (0..7).

The throughput loop does, per decision, what the router does: `index.match` merged with the
`PendingPrefixes` overlay's match (`merge_matches`), `policy.choose`, `pending.record` of the
chain on the chosen worker, and an update of the chosen worker's load (+ its uncached tokens and
one in flight, wrapped to stay in range as a stand-in for completions). The overlay's clock
advances 1 ms per decision (two clock reads), so with its 2 s TTL it holds ~2,000 live chains,
as at 1,000 requests/s; it is warmed up before timing. The latency loop times the same decision
(both matches, merge, choose, record) with `perf_counter_ns` around each one. `overlay=False`
gives the index-only figures. Hashing the prompt is not part of a decision; its
cost is reported next to it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from itertools import count
from typing import Any

from tandem.engine.cache_namespace import CacheNamespace
from tandem.engine.hashing import hash_full_blocks
from tandem.router.pending_prefixes import PendingPrefixes, merge_matches
from tandem.router.prefix_index import KVEventBatch, PrefixIndex
from tandem.router.routing_policy import CacheAffinity, RoutingConfig, WorkerLoad

BS = 16
NUM_CHAINS = 4096


def _setup(num_workers: int, seed: int = 0) -> tuple[str, PrefixIndex, list[list[int]], dict]:
    ns = CacheNamespace(model_revision="d", tokenizer_digest="d", rope_digest="d", kv_dtype="bf16")
    namespace, root = ns.digest(), ns.root_hash()
    rng = random.Random(seed)
    groups = max(32, 8 * num_workers)
    prefixes = []
    for _ in range(groups + groups // 8):  # the last eighth is never stored: unknown groups
        tokens = [rng.randrange(1, 32000) for _ in range(1024)]
        prefixes.append((tokens, hash_full_blocks(root, tokens, BS)))
    worker_ids = [f"prefill-{i}" for i in range(num_workers)]
    held: dict[str, list[int]] = {w: [] for w in worker_ids}
    for g in range(groups):
        owners = {worker_ids[g % num_workers]}
        if g % 4 == 0:
            owners.add(worker_ids[rng.randrange(num_workers)])
        tokens, chain = prefixes[g]
        tail = tokens + [rng.randrange(1, 32000) for _ in range(64)]
        chain = chain + hash_full_blocks(root, tail, BS, len(chain), chain[-1])
        for w in owners:
            held[w].extend(chain)
    index = PrefixIndex()
    for w, hashes in held.items():
        index.apply(KVEventBatch(worker_id=w, seq=0, namespace=namespace, stored=hashes))
    chains = []
    for _ in range(NUM_CHAINS):
        tokens, prefix = prefixes[rng.randrange(len(prefixes))]
        full = tokens + [rng.randrange(1, 32000) for _ in range(64)]
        chains.append(prefix + hash_full_blocks(root, full, BS, len(prefix), prefix[-1]))
    loads = {w: WorkerLoad(w, rng.randrange(4096), rng.randrange(8)) for w in worker_ids}
    return namespace, index, chains, loads


def _pending(namespace: str, chains: list, loads: dict, overlay: bool) -> PendingPrefixes | None:
    """An overlay with a fake clock (0.5 ms per read), warmed up to its steady size."""
    if not overlay:
        return None
    pending = PendingPrefixes(2.0, clock=partial(next, count(0.0, 0.0005)))
    workers = list(loads)
    for i in range(2 * 2000):
        pending.record(workers[i % len(workers)], namespace, chains[i % NUM_CHAINS])
    return pending


def _throughput(
    namespace: str, index: PrefixIndex, chains: list, loads: dict, n: int, overlay: bool
) -> float:
    policy = CacheAffinity(RoutingConfig())
    pending = _pending(namespace, chains, loads, overlay)
    match, choose = index.match, policy.choose
    mask = NUM_CHAINS - 1
    t0 = time.perf_counter()
    if pending is None:
        for i in range(n):
            matched = match(namespace, chains[i & mask])
            wid = choose(loads, matched)
            load = loads[wid]
            uncached = 1088 - 16 * matched.get(wid, 0)
            loads[wid] = WorkerLoad(
                wid, (load.queued_prefill_tokens + uncached) & 4095, (load.in_flight + 1) & 7
            )
    else:
        pmatch, record = pending.match, pending.record
        for i in range(n):
            chain = chains[i & mask]
            matched = merge_matches(match(namespace, chain), pmatch(namespace, chain))
            wid = choose(loads, matched)
            record(wid, namespace, chain)
            load = loads[wid]
            uncached = 1088 - 16 * matched.get(wid, 0)
            loads[wid] = WorkerLoad(
                wid, (load.queued_prefill_tokens + uncached) & 4095, (load.in_flight + 1) & 7
            )
    return n / (time.perf_counter() - t0)


def _latencies(
    namespace: str, index: PrefixIndex, chains: list, loads: dict, n: int, overlay: bool
) -> list:
    policy = CacheAffinity(RoutingConfig())
    pending = _pending(namespace, chains, loads, overlay)
    match, choose = index.match, policy.choose
    clock = time.perf_counter_ns
    mask = NUM_CHAINS - 1
    out = [0] * n
    if pending is None:
        for i in range(n):
            chain = chains[i & mask]
            t0 = clock()
            choose(loads, match(namespace, chain))
            out[i] = clock() - t0
    else:
        pmatch, record = pending.match, pending.record
        for i in range(n):
            chain = chains[i & mask]
            t0 = clock()
            record(
                choose(loads, merge_matches(match(namespace, chain), pmatch(namespace, chain))),
                namespace,
                chain,
            )
            out[i] = clock() - t0
    return out


def measure_decisions(
    num_workers: int, n: int, repeats: int, log: Callable[[str], None], overlay: bool = True
) -> dict[str, Any]:
    """Decisions per second (median of `repeats` loops of `n`) and latency percentiles."""
    namespace, index, chains, loads = _setup(num_workers)
    args = (namespace, index, chains)
    rates = [_throughput(*args, dict(loads), n, overlay) for _ in range(repeats)]
    lat = sorted(x for _ in range(repeats) for x in _latencies(*args, loads, n, overlay))

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] / 1000

    prompt = list(range(1088))
    t0 = time.perf_counter()
    for _ in range(200):
        hash_full_blocks(1, prompt, BS)
    hash_us = (time.perf_counter() - t0) / 200 * 1e6
    matched_sizes = [len(index.match(namespace, c)) for c in chains]
    result = {
        "workers": num_workers,
        "overlay": overlay,
        "decisions_per_s": round(statistics.median(rates)),
        "decisions_per_s_all": [round(r) for r in rates],
        "p50_us": round(pct(0.50), 2),
        "p99_us": round(pct(0.99), 2),
        "p999_us": round(pct(0.999), 2),
        "max_us": round(lat[-1] / 1000, 1),
        "mean_matched_workers": round(sum(matched_sizes) / len(matched_sizes), 2),
        "hash_1088_tokens_us": round(hash_us, 1),
    }
    log(
        f"\n## decisions, {num_workers} workers, {'with' if overlay else 'without'} overlay: "
        f"{result['decisions_per_s']:,}/s "
        f"(runs {result['decisions_per_s_all']}), p50 {result['p50_us']} us, "
        f"p99 {result['p99_us']} us, p99.9 {result['p999_us']} us, max {result['max_us']} us; "
        f"{result['mean_matched_workers']} matched workers per request; "
        f"hashing a 1,088-token prompt {result['hash_1088_tokens_us']} us (not in a decision)"
    )
    return result
