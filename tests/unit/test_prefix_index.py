"""PrefixIndex: exact longest-prefix matches, removals, sequence gaps and snapshots, dead workers,
namespaces, and the index fed by a real BlockManager's events."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from tandem.engine.block_manager import BlockManager, KVEvent
from tandem.engine.hashing import hash_full_blocks
from tandem.router.prefix_index import KVEventBatch, PrefixIndex

NS = "ns-a"
CHAIN = [101, 102, 103, 104, 105]


def batch(
    worker: str,
    seq: int,
    stored: Sequence[int] = (),
    removed: Sequence[int] = (),
    *,
    ns: str = NS,
    snapshot: bool = False,
) -> KVEventBatch:
    return KVEventBatch(
        worker_id=worker,
        seq=seq,
        namespace=ns,
        stored=list(stored),
        removed=list(removed),
        snapshot=snapshot,
    )


@pytest.fixture
def index() -> PrefixIndex:
    idx = PrefixIndex()
    assert idx.apply(batch("a", 0, CHAIN))
    assert idx.apply(batch("b", 0, [101, 102, 103, 105]))  # a hole at 104
    assert idx.apply(batch("c", 0, [102, 103, 104]))  # no block 0
    return idx


def test_longest_prefix_is_exact(index: PrefixIndex) -> None:
    assert index.match(NS, CHAIN) == {"a": 5, "b": 3}
    assert index.match(NS, CHAIN[:2]) == {"a": 2, "b": 2}
    assert index.match(NS, [101, 999, 103]) == {"a": 1, "b": 1}
    assert index.match(NS, [102, 103, 104]) == {"a": 3, "b": 2, "c": 3}
    assert index.match(NS, [999, *CHAIN]) == {}
    assert index.match(NS, []) == {}
    assert index.workers() == {"a", "b", "c"}


def test_match_restricted_to_workers(index: PrefixIndex) -> None:
    assert index.match(NS, CHAIN, workers=["b", "zzz"]) == {"b": 3}
    assert index.match(NS, CHAIN, workers=[]) == {}


def test_removal_events(index: PrefixIndex) -> None:
    assert index.apply(batch("a", 1, removed=[103]))
    assert index.match(NS, CHAIN) == {"a": 2, "b": 3}
    assert index.apply(batch("b", 1, removed=[101, 999]))  # an unknown hash is ignored
    assert index.match(NS, CHAIN) == {"a": 2}
    assert index.apply(batch("a", 2, stored=[103], removed=[101]))
    assert index.match(NS, CHAIN) == {}
    assert index.num_blocks("a") == 4


def test_gap_makes_worker_stale_until_snapshot(index: PrefixIndex) -> None:
    assert not index.apply(batch("a", 2, removed=[105]))  # seq 1 was lost
    assert index.needs_snapshot("a")
    assert index.match(NS, CHAIN) == {"b": 3}  # a's entries are not trusted
    assert not index.apply(batch("a", 3, stored=[101]))  # ignored while stale
    assert index.match(NS, CHAIN) == {"b": 3}
    assert index.apply(batch("a", 4, [101, 102], snapshot=True))
    assert not index.needs_snapshot("a")
    assert index.match(NS, CHAIN) == {"a": 2, "b": 3}
    assert index.apply(batch("a", 5, [103]))  # the stream goes on from the snapshot
    assert index.match(NS, CHAIN) == {"a": 3, "b": 3}


def test_reordered_batch_is_detected(index: PrefixIndex) -> None:
    late, early = batch("b", 1, removed=[101]), batch("b", 2, stored=[104])
    assert not index.apply(early)  # arrives first: a gap
    assert not index.apply(late)  # arrives second: already stale, ignored
    assert index.needs_snapshot("b")
    assert index.match(NS, CHAIN) == {"a": 5}


def test_duplicate_and_old_snapshot_are_ignored(index: PrefixIndex) -> None:
    assert index.apply(batch("a", 1, removed=[105]))
    assert not index.apply(batch("a", 1, removed=[105]))  # delivered twice
    assert not index.apply(batch("a", 0, [], snapshot=True))  # overtaken by newer batches
    assert not index.needs_snapshot("a")
    assert index.match(NS, CHAIN)["a"] == 4


def test_stream_must_start_at_zero_or_with_a_snapshot() -> None:
    idx = PrefixIndex()
    assert not idx.apply(batch("late", 7, CHAIN))
    assert idx.needs_snapshot("late")
    assert idx.match(NS, CHAIN) == {}
    assert idx.apply(batch("fresh", 9, CHAIN, snapshot=True))
    assert idx.match(NS, CHAIN) == {"fresh": 5}
    idx.mark_stale("fresh")
    assert idx.needs_snapshot("fresh") and idx.match(NS, CHAIN) == {}


def test_dead_worker_is_dropped(index: PrefixIndex) -> None:
    index.remove_worker("a")
    index.remove_worker("unknown")
    assert index.workers() == {"b", "c"}
    assert index.match(NS, CHAIN) == {"b": 3}
    assert not index.needs_snapshot("a")
    assert index.apply(batch("d", 0, [101]))  # reuses a's bit without inheriting its blocks
    assert index.match(NS, CHAIN) == {"b": 3, "d": 1}
    for w in ("b", "c", "d"):
        index.remove_worker(w)
    assert index.workers() == set()
    assert index.match(NS, CHAIN) == {}


def test_namespaces_never_mix() -> None:
    idx = PrefixIndex()
    assert idx.apply(batch("a", 0, CHAIN, ns="ns-a"))
    assert idx.apply(batch("b", 0, CHAIN[:3], ns="ns-b"))
    assert idx.apply(batch("a", 1, CHAIN[:1], ns="ns-b"))
    assert idx.match("ns-a", CHAIN) == {"a": 5}
    assert idx.match("ns-b", CHAIN) == {"b": 3, "a": 1}
    assert idx.match("ns-c", CHAIN) == {}
    assert idx.apply(batch("a", 2, removed=CHAIN, ns="ns-b"))
    assert idx.match("ns-a", CHAIN) == {"a": 5}
    assert idx.num_blocks("a", "ns-a") == 5 and idx.num_blocks("a", "ns-b") == 0
    # a snapshot replaces the worker's entries in every namespace
    assert idx.apply(batch("b", 1, CHAIN[:2], ns="ns-a", snapshot=True))
    assert idx.match("ns-b", CHAIN) == {}
    assert idx.match("ns-a", CHAIN) == {"a": 5, "b": 2}


class CountingChain(Sequence[int]):
    """A chain that counts how many of its hashes a match reads."""

    def __init__(self, hashes: list[int]) -> None:
        self.hashes = hashes
        self.reads = 0

    def __len__(self) -> int:
        return len(self.hashes)

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        self.reads += 1
        return self.hashes[i]

    def __iter__(self) -> Iterator[int]:
        for h in self.hashes:
            self.reads += 1
            yield h


def test_match_reads_only_matched_blocks() -> None:
    idx = PrefixIndex()
    assert idx.apply(batch("a", 0, [1, 2, 3]))
    assert idx.apply(batch("b", 0, [1, 2]))
    chain = CountingChain([1, 2, 3, *range(1000, 11_000)])
    assert idx.match(NS, chain) == {"a": 3, "b": 2}
    assert chain.reads <= 1 + (3 + 1) + (2 + 1)
    miss = CountingChain(list(range(1000, 11_000)))
    assert idx.match(NS, miss) == {}
    assert miss.reads == 1


def test_batch_json_round_trip_and_coalescing() -> None:
    events = [
        KVEvent("stored", 1, None, 0),
        KVEvent("stored", 2, 1, 1),
        KVEvent("removed", 2, None, 1),  # stored then removed: removed
        KVEvent("removed", 3, None, 2),
        KVEvent("stored", 3, 9, 2),  # removed then stored again: stored
    ]
    b = KVEventBatch.from_kv_events("w", 4, NS, events)
    assert (b.stored, b.removed, b.snapshot) == ([1, 3], [2], False)
    assert KVEventBatch.model_validate_json(b.model_dump_json()) == b


def test_index_follows_a_real_block_manager() -> None:
    """Requests through a BlockManager with evictions: the index always agrees with it."""
    bs, root = 4, 12345
    bm = BlockManager(num_blocks=12, block_size=bs)
    idx = PrefixIndex()
    tables: list[list[int]] = []
    prompts = [[g] * 8 + [g, i, i, i] for g in range(1, 5) for i in range(3)]
    for seq, tokens in enumerate(prompts):
        hashes = hash_full_blocks(root, tokens, bs)
        hits = bm.match_prefix(hashes, tokens)
        expected = idx.match(NS, hashes).get("w", 0)
        assert expected == len(hits), tokens
        table: list[int] = []
        if len(tables) == 2:  # at most two requests alive; the oldest leaves
            bm.free(tables.pop(0))
        computed = hits[: (len(tokens) - 1) // bs]
        assert bm.allocate(table, len(tokens), computed)
        bm.cache_blocks(table, hashes, tokens, len(computed))
        tables.append(table)
        assert idx.apply(KVEventBatch.from_kv_events("w", seq, NS, bm.drain_events()))
        assert idx.num_blocks("w") == sum(bm.cached_hash(b) is not None for b in range(12))


def test_snapshots_that_overlap_what_is_held_leave_exactly_their_blocks() -> None:
    # (a snapshot is applied as the difference from what the index holds: same result as
    # clearing the worker and storing the snapshot, with random batches in between)
    import random

    rng = random.Random(5)
    idx = PrefixIndex()
    held: dict[str, dict[str, set[int]]] = {w: {"x": set(), "y": set()} for w in "ab"}
    seq = dict.fromkeys("ab", -1)
    for _ in range(300):
        worker, ns = rng.choice("ab"), rng.choice("xy")
        seq[worker] += 1
        hashes = set(rng.sample(range(40), rng.randint(0, 25)))
        if rng.random() < 0.3:
            assert idx.apply(batch(worker, seq[worker], sorted(hashes), ns=ns, snapshot=True))
            held[worker] = {"x": set(), "y": set(), ns: hashes}
        else:
            removed = set(rng.sample(sorted(held[worker][ns]), len(held[worker][ns]) // 3))
            stored = hashes - removed
            assert idx.apply(batch(worker, seq[worker], sorted(stored), sorted(removed), ns=ns))
            held[worker][ns] = (held[worker][ns] - removed) | stored
        for space in "xy":
            for h in range(40):
                want = {w: 1 for w in "ab" if h in held[w][space]}
                assert idx.match(space, [h]) == want, (space, h)
            for w in "ab":
                assert idx.num_blocks(w, space) == len(held[w][space])


def test_a_publisher_s_batches_keep_the_index_equal_to_its_cache_with_evictions_in_between() -> (
    None
):
    """Blocks stored and evicted again between two batches (a busy worker under memory
    pressure): every batch's count and digest agree with the index, which ends equal to the
    worker's cache. Raw event lists would put such a hash in both `stored` and `removed`, and
    the index (which removes first) would keep a block the worker no longer has."""
    import random

    from tandem.engine.kv_event_publisher import KVEventPublisher

    rng = random.Random(11)
    pub, idx = KVEventPublisher("w", NS), PrefixIndex()
    assert idx.apply(KVEventBatch.model_validate(pub.snapshot()))  # (a subscription's start)
    for _ in range(200):
        events = []
        for _ in range(rng.randint(1, 12)):
            h = rng.randrange(30) + (1 << 63)  # (64-bit hashes, as xxhash gives)
            events.append(KVEvent("stored" if rng.random() < 0.6 else "removed", h, None, 0))
        pub.collect(events)
        raw = pub.take_batch()
        assert raw is not None
        assert not set(raw["stored"]) & set(raw["removed"])
        assert idx.apply(KVEventBatch.model_validate(raw)), raw
        assert idx.num_blocks("w", NS) == len(pub.cached) == raw["held"]
        assert idx.match(NS, sorted(pub.cached)[:1]) == ({"w": 1} if pub.cached else {})
    held = {h for h in range(1 << 63, (1 << 63) + 30) if idx.match(NS, [h])}
    assert held == pub.cached


def test_a_batch_whose_count_or_digest_disagrees_makes_the_worker_stale_until_a_snapshot() -> None:
    idx = PrefixIndex()
    assert idx.apply(batch("a", 0, [1, 2, 4]))
    ok = batch("a", 1, [8])
    ok.held, ok.digest = 4, 1 ^ 2 ^ 4 ^ 8
    assert idx.apply(ok)
    lost = batch("a", 2, [16])  # the worker also evicted block 2: a change the index missed
    lost.held, lost.digest = 4, 1 ^ 4 ^ 8 ^ 16
    assert not idx.apply(lost)
    assert idx.needs_snapshot("a") and idx.match(NS, [1]) == {}
    later = batch("a", 3, [32])  # ignored until the snapshot
    assert not idx.apply(later)
    snap = batch("a", 4, [1, 4, 8, 16], snapshot=True)
    assert idx.apply(snap) and not idx.needs_snapshot("a")
    assert idx.match(NS, [1]) == {"a": 1} and idx.match(NS, [2]) == {}
    assert idx.num_blocks("a", NS) == 4
