"""The routed-but-not-yet-published overlay: record/match, expiry, namespaces, workers, caps."""

from __future__ import annotations

import pytest

from tandem.router.pending_prefixes import PendingPrefixes, merge_matches


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chain(tag: int, n: int, prefix: list[int] | None = None) -> list[int]:
    """A hash chain: `prefix` (if any) then n fresh hashes (tag keeps chains apart)."""
    start = list(prefix or [])
    return start + [tag * 1000 + len(start) + i for i in range(n)]


SYS = chain(1, 8)  # a shared 8-block system prompt
A = chain(2, 3, SYS)  # two requests of the same group: 8 shared blocks, 3 own ones
B = chain(3, 3, SYS)


def test_record_then_match_counts_leading_blocks() -> None:
    p = PendingPrefixes(clock=Clock())
    assert p.match("ns", A) == {}
    p.record("w1", "ns", A)
    assert p.match("ns", A) == {"w1": 11}
    assert p.match("ns", B) == {"w1": 8}  # the shared prefix only
    assert p.match("ns", SYS[:5]) == {"w1": 5}
    assert p.match("ns", chain(9, 4)) == {}  # unknown first block
    assert p.match("ns", []) == {}
    p.record("w2", "ns", SYS[:4])
    assert p.match("ns", B) == {"w1": 8, "w2": 4}
    assert p.match("ns", B, workers=["w2", "w3"]) == {"w2": 4}
    assert p.match("ns", B, workers=[]) == {}
    p.record("w3", "ns", [])  # nothing to record
    assert len(p) == 2 and p.num_blocks == 15


def test_entries_expire_after_ttl_keeping_newer_records() -> None:
    clock = Clock()
    p = PendingPrefixes(ttl_s=2.0, clock=clock)
    p.record("w1", "ns", A)
    clock.now = 1.0
    p.record("w1", "ns", B)  # re-records the shared prefix at t=1
    clock.now = 1.99
    assert p.match("ns", A) == {"w1": 11}
    clock.now = 2.0  # A's entry expires; the prefix stays, B recorded it again
    assert p.match("ns", A) == {"w1": 8}
    assert p.match("ns", B) == {"w1": 11}
    assert len(p) == 1
    clock.now = 3.0
    assert p.match("ns", B) == {}
    assert len(p) == 0 and p.num_blocks == 0
    p.record("w1", "ns", A)  # usable again after it emptied
    assert p.match("ns", A) == {"w1": 11}


def test_expiry_also_runs_on_record() -> None:
    clock = Clock()
    p = PendingPrefixes(ttl_s=1.0, clock=clock)
    for i in range(10):
        clock.now = float(i)
        p.record("w1", "ns", chain(10 + i, 4))
    assert len(p) == 1  # only the newest is younger than 1 s


def test_namespaces_are_separate() -> None:
    p = PendingPrefixes(clock=Clock())
    p.record("w1", "ns-a", A)
    p.record("w2", "ns-b", SYS[:2])
    assert p.match("ns-a", A) == {"w1": 11}
    assert p.match("ns-b", A) == {"w2": 2}
    assert p.match("ns-c", A) == {}


def test_remove_worker_forgets_only_that_worker() -> None:
    clock = Clock()
    p = PendingPrefixes(ttl_s=5.0, clock=clock)
    p.record("w1", "ns-a", A)
    p.record("w1", "ns-b", A)
    p.record("w2", "ns-a", B)
    p.remove_worker("w1")
    p.remove_worker("nobody")
    assert p.match("ns-a", A) == {"w2": 8}
    assert p.match("ns-b", A) == {}
    p.record("w1", "ns-a", SYS[:3])  # the id comes back: only new records count
    assert p.match("ns-a", A) == {"w2": 8, "w1": 3}
    clock.now = 5.0  # the removed worker's old entries expire harmlessly
    assert p.match("ns-a", A) == {}
    assert len(p) == 0 and p.num_blocks == 0


def test_entry_cap_evicts_the_oldest() -> None:
    p = PendingPrefixes(clock=Clock(), max_entries=3)
    chains = [chain(20 + i, 4) for i in range(5)]
    for i, c in enumerate(chains):
        p.record(f"w{i}", "ns", c)
    assert len(p) == 3
    assert [p.match("ns", c) for c in chains] == [{}, {}, {"w2": 4}, {"w3": 4}, {"w4": 4}]


def test_block_cap_evicts_the_oldest_and_truncates_long_chains() -> None:
    p = PendingPrefixes(clock=Clock(), max_blocks=10)
    p.record("w1", "ns", chain(30, 4))
    p.record("w2", "ns", chain(31, 4))
    p.record("w3", "ns", chain(32, 4))  # 12 > 10: the first entry goes
    assert p.match("ns", chain(30, 4)) == {}
    assert p.match("ns", chain(31, 4)) == {"w2": 4}
    assert p.num_blocks == 8
    p.record("w4", "ns", chain(33, 25))  # longer than the cap: its first 10 blocks are kept
    assert p.match("ns", chain(33, 25)) == {"w4": 10}
    assert len(p) == 1 and p.num_blocks == 10


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        PendingPrefixes(ttl_s=0)
    with pytest.raises(ValueError):
        PendingPrefixes(max_entries=0)


def test_merge_matches_takes_the_max_per_worker() -> None:
    assert merge_matches({"a": 5, "b": 2}, {"b": 7, "c": 1}) == {"a": 5, "b": 7, "c": 1}
    assert merge_matches({"a": 5}, {"a": 3}) == {"a": 5}
    assert merge_matches({}, {"a": 3}) == {"a": 3}
    index = {"a": 1}
    merged = merge_matches(index, {})
    assert merged == {"a": 1} and merged is not index
