"""BlockManager on 8 blocks of 4 tokens: exact block ids, LRU order, prefix hits, pins, events."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import pytest

from tandem.engine.block_manager import BlockManager, KVEvent
from tandem.engine.cache_namespace import CacheNamespace
from tandem.engine.hashing import hash_full_blocks

BS = 4
NS_A = CacheNamespace(model_revision="r", tokenizer_digest="t", rope_digest="p", kv_dtype="bf16")
NS_B = NS_A.model_copy(update={"adapter_id": "lora-b"})
ROOT = NS_A.root_hash()


class Env:
    """A manager plus the live block tables of its requests, checked after every test."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.tables: dict[str, list[int]] = {}

    def run(self, name: str, tokens: Sequence[int], root: int = ROOT) -> list[int] | None:
        """Admit a request like a scheduler would: match, allocate, then cache its full blocks."""
        hashes = hash_full_blocks(root, tokens, BS)
        computed = self.bm.match_prefix(hashes, tokens)
        if len(computed) * BS == len(tokens):
            computed = computed[:-1]  # leave one token to compute
        table: list[int] = []
        if not self.bm.allocate(table, len(tokens), computed):
            return None
        self.tables[name] = table
        self.bm.cache_blocks(table, hashes, tokens, len(computed))
        return table

    def release(self, name: str) -> None:
        self.bm.free(self.tables.pop(name))

    def check(self) -> None:
        self.bm.check_integrity(self.tables.values())


@pytest.fixture
def make_env() -> Iterator[Callable[..., Env]]:
    envs: list[Env] = []

    def factory(num_blocks: int = 8, enable_prefix_caching: bool = True) -> Env:
        env = Env(BlockManager(num_blocks, BS, enable_prefix_caching))
        envs.append(env)
        return env

    yield factory
    for env in envs:
        env.check()


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_fresh_allocation(env: Env) -> None:
    assert env.run("a", toks(0, 9)) == [0, 1, 2]
    assert env.bm.num_free_blocks == 5
    assert env.bm.usage == pytest.approx(3 / 8)
    table = env.tables["a"]
    assert env.bm.allocate(table, 12)  # still fits in 3 blocks
    assert table == [0, 1, 2]
    assert env.bm.allocate(table, 13)
    assert table == [0, 1, 2, 3]


def test_reallocation_follows_lru_and_reverse_free_order(env: Env) -> None:
    assert env.run("a", toks(0, 10)) == [0, 1, 2]  # blocks 0 and 1 are full and cached
    env.release("a")  # free queue: 3 4 5 6 7 2 1 0
    assert env.bm.num_free_blocks == 8
    assert env.run("b", toks(100, 21)) == [3, 4, 5, 6, 7, 2]  # block 2 was never cached
    assert env.bm.match_prefix(hash_full_blocks(ROOT, toks(0, 10), BS), toks(0, 10)) == [0, 1]
    assert env.run("c", toks(200, 4)) == [1]  # evicts block 1 (tail of "a") before block 0
    assert env.bm.match_prefix(hash_full_blocks(ROOT, toks(0, 10), BS), toks(0, 10)) == [0]


def test_match_after_eviction_misses(env: Env) -> None:
    assert env.run("a", toks(0, 8)) == [0, 1]
    env.release("a")  # free queue: 2..7 1 0
    assert env.run("b", toks(50, 32)) == [2, 3, 4, 5, 6, 7, 1, 0]
    env.release("b")
    assert env.bm.match_prefix(hash_full_blocks(ROOT, toks(0, 8), BS), toks(0, 8)) == []
    assert env.bm.prefix_cache_stats.evicted_blocks == 2  # (blocks 1 and 0: "a"'s cached ones)


def test_prefix_hits_only_on_full_blocks(env: Env) -> None:
    assert env.run("a", toks(0, 10)) == [0, 1, 2]
    assert env.bm.cached_hash(2) is None  # partial block
    for n, expected in [(3, []), (4, [0]), (7, [0]), (8, [0, 1]), (10, [0, 1]), (12, [0, 1])]:
        tokens = toks(0, n)
        assert env.bm.match_prefix(hash_full_blocks(ROOT, tokens, BS), tokens) == expected


def test_shared_prefix_ref_counts(env: Env) -> None:
    assert env.run("a", toks(0, 10)) == [0, 1, 2]
    assert env.run("b", [*toks(0, 8), 77, 78]) == [0, 1, 3]
    assert [env.bm.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert env.bm.num_free_blocks == 4
    env.check()
    env.release("a")
    assert [env.bm.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert env.bm.num_free_blocks == 5
    env.check()
    env.release("b")
    assert env.bm.num_free_blocks == 8
    assert env.bm.prefix_cache_stats.hit_blocks == 2


def test_fully_cached_prompt_recomputes_last_block(env: Env) -> None:
    assert env.run("a", toks(0, 8)) == [0, 1]
    assert env.run("b", toks(0, 8)) == [0, 2]  # block 1 is recomputed into block 2
    assert env.bm.cached_hash(2) is None  # duplicate of block 1: stays uncached
    env.release("b")
    env.release("a")


def test_pin_prevents_reuse_and_unpin_returns_block(env: Env) -> None:
    env.bm.pin([0])
    assert env.bm.num_free_blocks == 7
    assert not env.bm.allocate([], 32)  # 8 blocks, only 7 can be handed out
    assert env.run("a", toks(0, 12)) == [1, 2, 3]
    env.bm.unpin([0])  # goes to the back of the free queue
    assert env.run("b", toks(100, 20)) == [4, 5, 6, 7, 0]


def test_pins_nest_and_outlive_references(env: Env) -> None:
    assert env.run("a", toks(0, 8)) == [0, 1]
    env.bm.pin([1, 1])
    env.release("a")  # free queue: 2..7 0; block 1 is pinned
    assert env.bm.num_free_blocks == 7
    env.bm.unpin([1])
    assert env.bm.num_free_blocks == 7
    assert env.bm.pin_count(1) == 1
    assert env.run("b", toks(100, 28)) == [2, 3, 4, 5, 6, 7, 0]
    # The pinned block kept its hash; block 0 before it was evicted, so the prefix misses.
    hashes = hash_full_blocks(ROOT, toks(0, 8), BS)
    assert env.bm.cached_hash(1) == hashes[1]
    assert env.bm.match_prefix(hashes, toks(0, 8)) == []
    env.bm.unpin([1])
    assert env.bm.num_free_blocks == 1
    with pytest.raises(RuntimeError, match="not pinned"):
        env.bm.unpin([1])


def test_pinned_unreferenced_block_can_be_a_prefix_hit(env: Env) -> None:
    assert env.run("a", toks(0, 10)) == [0, 1, 2]
    env.bm.pin([0, 1])
    env.release("a")
    table: list[int] = []
    assert env.bm.can_allocate(1, [0, 1])
    assert env.bm.allocate(table, 10, [0, 1])
    assert table == [0, 1, 3]
    env.tables["b"] = table
    env.bm.unpin([0, 1])  # still referenced: stays out of the free queue
    assert env.bm.num_free_blocks == 5


def test_double_free_raises_and_changes_nothing(env: Env) -> None:
    table = env.run("a", toks(0, 8))
    assert table == [0, 1]
    env.release("a")
    with pytest.raises(RuntimeError, match="double free"):
        env.bm.free(table)
    assert env.bm.num_free_blocks == 8


def test_allocate_is_all_or_nothing(env: Env) -> None:
    assert env.run("a", toks(0, 16)) == [0, 1, 2, 3]
    env.release("a")  # free queue: 4 5 6 7 3 2 1 0, blocks 0..3 cached
    env.bm.drain_events()
    hashes = hash_full_blocks(ROOT, toks(0, 36), BS)
    computed = env.bm.match_prefix(hashes, toks(0, 36))
    assert computed == [0, 1, 2, 3]
    assert not env.bm.can_allocate(5, computed)  # 8 free, 4 of them are the computed blocks
    assert env.bm.can_allocate(4, computed)
    table: list[int] = []
    assert not env.bm.allocate(table, 36, computed)  # needs 4 + 5 blocks
    assert table == []
    assert env.bm.num_free_blocks == 8
    assert all(env.bm.ref_count(b) == 0 for b in range(8))
    assert env.bm.drain_events() == []
    assert env.bm.allocate(table, 32, computed)
    assert table == [0, 1, 2, 3, 4, 5, 6, 7]
    env.tables["b"] = table


def test_allocate_rejects_evicted_computed_blocks(env: Env) -> None:
    assert env.run("a", toks(0, 8)) == [0, 1]
    env.release("a")  # free queue: 2..7 1 0
    computed = env.bm.match_prefix(hash_full_blocks(ROOT, toks(0, 8), BS), toks(0, 8))
    # Evicts block 1, which then holds b's partial last block (so it stays uncached). The check is
    # best-effort: a recycled block that is cached again under another hash is not detected.
    assert env.run("b", toks(100, 27)) == [2, 3, 4, 5, 6, 7, 1]
    with pytest.raises(RuntimeError, match="evicted"):
        env.bm.allocate([], 8, computed)


def test_namespaces_never_share_blocks(env: Env) -> None:
    tokens = toks(0, 12)
    assert env.run("a", tokens, NS_A.root_hash()) == [0, 1, 2]
    assert env.bm.match_prefix(hash_full_blocks(NS_B.root_hash(), tokens, BS), tokens) == []
    assert env.run("b", tokens, NS_B.root_hash()) == [3, 4, 5]
    assert all(env.bm.ref_count(b) == 1 for b in range(6))


def test_hash_collision_guard(env: Env) -> None:
    assert env.run("a", toks(0, 8)) == [0, 1]
    hashes = hash_full_blocks(ROOT, toks(0, 8), BS)
    # Pretend other tokens hash to the same chain: the token comparison must reject them.
    assert env.bm.match_prefix(hashes, toks(1000, 8)) == []
    assert env.bm.match_prefix(hashes, [*toks(0, 4), 9, 9, 9, 9]) == [0]


def test_events_in_order(env: Env) -> None:
    h = hash_full_blocks(ROOT, toks(0, 12), BS)
    assert env.run("a", toks(0, 12)) == [0, 1, 2]
    assert env.bm.drain_events() == [
        KVEvent("stored", h[0], None, 0),
        KVEvent("stored", h[1], h[0], 1),
        KVEvent("stored", h[2], h[1], 2),
    ]
    assert env.bm.drain_events() == []
    env.release("a")  # free queue: 3..7 2 1 0
    assert env.run("b", toks(100, 27)) == [3, 4, 5, 6, 7, 2, 1]
    g = hash_full_blocks(ROOT, toks(100, 27), BS)
    events = env.bm.drain_events()
    assert events[:2] == [KVEvent("removed", h[2], None, 2), KVEvent("removed", h[1], None, 1)]
    assert [e.kind for e in events[2:]] == ["stored"] * 6
    assert [e.block_hash for e in events[2:]] == g
    env.release("b")
    assert env.bm.reset_prefix_cache() == 7
    removed = env.bm.drain_events()
    assert {e.block_hash for e in removed} == {h[0], *g}
    assert all(e.kind == "removed" for e in removed)


def test_cache_blocks_grows_incrementally_during_decode(env: Env) -> None:
    tokens = toks(0, 6)
    table = env.run("a", tokens)
    assert table == [0, 1]
    num_cached = 1
    for t in range(6, 13):  # decode one token at a time
        tokens.append(t)
        assert env.bm.allocate(table, len(tokens))
        hashes = hash_full_blocks(ROOT, tokens, BS)
        num_cached = env.bm.cache_blocks(table, hashes, tokens, num_cached)
    assert table == [0, 1, 2, 3]
    assert num_cached == 3
    assert [env.bm.cached_hash(b) for b in table[:3]] == hash_full_blocks(ROOT, tokens, BS)
    assert env.bm.cached_hash(3) is None


def test_concurrent_duplicate_keeps_first_entry(env: Env) -> None:
    tokens = toks(0, 8)
    hashes = hash_full_blocks(ROOT, tokens, BS)
    a: list[int] = []
    b: list[int] = []
    assert env.bm.allocate(a, 8) and env.bm.allocate(b, 8)
    env.tables.update(a=a, b=b)
    assert env.bm.cache_blocks(a, hashes, tokens, 0) == 2
    assert env.bm.cache_blocks(b, hashes, tokens, 0) == 2
    assert [env.bm.cached_hash(x) for x in b] == [None, None]
    assert len(env.bm.drain_events()) == 2
    assert env.bm.match_prefix(hashes, tokens) == [0, 1]


def test_disabled_prefix_caching_never_matches(make_env: Callable[..., Env]) -> None:
    env = make_env(enable_prefix_caching=False)
    assert env.run("a", toks(0, 8)) == [0, 1]
    assert env.run("b", toks(0, 8)) == [2, 3]
    assert env.bm.match_prefix(hash_full_blocks(ROOT, toks(0, 8), BS), toks(0, 8)) == []
    assert env.bm.cached_hash(0) is None
    assert env.bm.drain_events() == []


def test_prefix_cache_stats(env: Env) -> None:
    env.run("a", toks(0, 12))  # 3 blocks asked, 0 hits
    env.run("b", toks(0, 9))  # 2 asked, 2 hits
    stats = env.bm.prefix_cache_stats
    assert (stats.queries, stats.queried_blocks, stats.hit_blocks) == (2, 5, 2)
    assert stats.hit_rate == pytest.approx(0.4)


def test_check_integrity_detects_corruption(env: Env) -> None:
    assert env.run("a", toks(0, 8)) == [0, 1]
    bm = env.bm
    with pytest.raises(RuntimeError, match="in 0 block tables"):
        bm.check_integrity([])
    bm._blocks[5].ref_count = 1  # referenced but still in the free queue
    with pytest.raises(RuntimeError, match="block 5 is in the free queue"):
        bm.check_integrity()
    bm._blocks[5].ref_count = 0
    del bm._free_queue[6]  # free but lost from the queue
    with pytest.raises(RuntimeError, match="block 6 is unreferenced"):
        bm.check_integrity()
    bm._free_queue[6] = None
    original = bm._blocks[0].block_hash
    bm._blocks[0].block_hash = 123  # per-block hash disagrees with the map
    with pytest.raises(RuntimeError, match="hash 0x7b not mapped to it"):
        bm.check_integrity()
    bm._blocks[0].block_hash = original
    env.check()


def test_random_workload_keeps_invariants(make_env: Callable[..., Env]) -> None:
    rng = random.Random(0)
    env = make_env(num_blocks=16)
    prompts = [toks(0, 13), toks(0, 6), [*toks(0, 8), 5, 5], toks(40, 9), toks(40, 4)]
    pinned: list[int] = []
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            env.run(f"r{step}", rng.choice(prompts))
        elif op < 0.8 and env.tables:
            env.release(rng.choice(sorted(env.tables)))
        elif op < 0.9:
            block = rng.randrange(16)
            env.bm.pin([block])
            pinned.append(block)
        elif pinned:
            env.bm.unpin([pinned.pop(rng.randrange(len(pinned)))])
        env.check()
        env.bm.drain_events()
    env.bm.unpin(pinned)
