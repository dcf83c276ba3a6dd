"""Routed but not yet published prefixes: a short-lived overlay next to the `PrefixIndex` (issue 5).

The exact index learns a worker's blocks from its KV events, which come only once the prefill has
run. Until then a group's next request with the same prefix would not see where the first one
went and would be sent elsewhere, recomputing the prefix. The router therefore `record`s each
routed request's hash chain on the chosen worker here, and routes on
`merge_matches(index.match(...), pending.match(...))`.

Entries expire `ttl_s` after they were recorded (by then the worker's events have normally
arrived, or the request failed); expired entries are dropped at the start of each call, in
recording order (amortized O(1) per entry, no background thread). Memory is bounded: at most
`max_entries` recorded chains and `max_blocks` hashes over all of them, the oldest evicted first.

Layout: per namespace and worker, `hash -> id of the newest entry that recorded it` (so an entry
that expires removes only the hashes no newer entry re-recorded), and per namespace, the chain's
first hash -> workers with a live entry starting with it. Hash chains are prefix-closed (a
block's hash covers every block before it), so a worker's leading match is one walk over its
hash dict until the first miss, in C. Like the index, the overlay is single-threaded and does no
I/O; `clock` is injectable (simulations count steps, tests step it by hand).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress, repeat, takewhile
from operator import eq
from typing import NamedTuple

__all__ = ["PendingPrefixes", "merge_matches"]


class _Entry(NamedTuple):
    expires: float
    entry_id: int
    worker_id: str
    namespace: str
    block_hashes: tuple[int, ...]


def merge_matches(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """Per worker, the larger of the two matched lengths (workers in either mapping)."""
    if not b:
        return dict(a)
    if not a:
        return dict(b)
    merged = dict(a)
    for worker_id, blocks in b.items():
        if blocks > merged.get(worker_id, 0):
            merged[worker_id] = blocks
    return merged


class PendingPrefixes:
    """Hash chains the router sent to workers in the last `ttl_s` seconds (see module docstring)."""

    __slots__ = (
        "_clock",
        "_entries",
        "_first",
        "_max_blocks",
        "_max_entries",
        "_next_id",
        "_num_blocks",
        "_ttl",
        "_workers",
    )

    def __init__(
        self,
        ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_entries: int = 8192,
        max_blocks: int = 1 << 20,
    ) -> None:
        if ttl_s <= 0 or max_entries <= 0 or max_blocks <= 0:
            raise ValueError("ttl_s, max_entries and max_blocks must be positive")
        self._ttl = ttl_s
        self._clock = clock
        self._max_entries = max_entries
        self._max_blocks = max_blocks
        self._entries: deque[_Entry] = deque()  # oldest first (expiry times never decrease)
        self._next_id = 0
        self._num_blocks = 0
        # namespace -> worker -> block hash -> id of the newest entry holding it
        self._workers: dict[str, dict[str, dict[int, int]]] = {}
        # namespace -> first hash of a chain -> worker -> id of the newest entry starting with it
        self._first: dict[str, dict[int, dict[str, int]]] = {}

    def __len__(self) -> int:
        """Live entries (recorded chains), as of the last call."""
        return len(self._entries)

    @property
    def num_blocks(self) -> int:
        """Hashes over all live entries (a hash recorded twice counts twice)."""
        return self._num_blocks

    def record(self, worker_id: str, namespace: str, block_hashes: Sequence[int]) -> None:
        """The router just sent a request with this hash chain to `worker_id`."""
        now = self._clock()
        self._expire(now)
        if not block_hashes:
            return
        hashes = tuple(block_hashes[: self._max_blocks])
        entry_id = self._next_id
        self._next_id += 1
        self._entries.append(_Entry(now + self._ttl, entry_id, worker_id, namespace, hashes))
        self._num_blocks += len(hashes)
        held = self._workers.setdefault(namespace, {}).setdefault(worker_id, {})
        held.update(zip(hashes, repeat(entry_id)))
        self._first.setdefault(namespace, {}).setdefault(hashes[0], {})[worker_id] = entry_id
        while len(self._entries) > self._max_entries or self._num_blocks > self._max_blocks:
            self._drop(self._entries.popleft())

    def match(
        self,
        namespace: str,
        block_hashes: Sequence[int],
        workers: Iterable[str] | None = None,
    ) -> dict[str, int]:
        """Worker -> leading blocks of `block_hashes` in its live entries, like `PrefixIndex.match`.

        Workers with no leading block are left out; `workers` restricts the candidates. Cost:
        O(1) to find the workers with a live chain starting at block 0, then O(matched blocks + 1)
        per such worker (plus the amortized expiry).
        """
        self._expire(self._clock())
        if not block_hashes:
            return {}
        firsts = self._first.get(namespace)
        if firsts is None:
            return {}
        starters = firsts.get(block_hashes[0])
        if not starters:
            return {}
        held = self._workers[namespace]
        allowed = None if workers is None else set(workers)
        result: dict[str, int] = {}
        for worker_id in starters:
            if allowed is None or worker_id in allowed:
                result[worker_id] = len(list(takewhile(held[worker_id].__contains__, block_hashes)))
        return result

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker's entries (it left or died); unknown ids are ignored.

        Its queued entries stay in the expiry queue until they expire (their ids no longer match
        anything), so they still count against the caps until then.
        """
        for namespace in list(self._workers):
            by_worker = self._workers[namespace]
            if by_worker.pop(worker_id, None) is None:
                continue
            if not by_worker:
                del self._workers[namespace]
            firsts = self._first[namespace]
            for first in [h for h, starters in firsts.items() if worker_id in starters]:
                starters = firsts[first]
                del starters[worker_id]
                if not starters:
                    del firsts[first]
            if not firsts:
                del self._first[namespace]

    # ---- internals ---------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries and entries[0].expires <= now:
            self._drop(entries.popleft())

    def _drop(self, entry: _Entry) -> None:
        """Remove what an entry added, except hashes a newer entry recorded again."""
        self._num_blocks -= len(entry.block_hashes)
        by_worker = self._workers.get(entry.namespace)
        held = by_worker.get(entry.worker_id) if by_worker is not None else None
        if held is None:  # the worker was removed
            return
        # Delete the hashes whose newest entry is this one; the loop runs in C.
        hashes = entry.block_hashes
        owned = compress(hashes, map(eq, map(held.get, hashes), repeat(entry.entry_id)))
        deque(map(held.__delitem__, owned), maxlen=0)
        firsts = self._first[entry.namespace]
        first = entry.block_hashes[0]
        starters = firsts.get(first)
        if starters is not None and starters.get(entry.worker_id) == entry.entry_id:
            del starters[entry.worker_id]
            if not starters:
                del firsts[first]
        if not held:
            del by_worker[entry.worker_id]  # type: ignore[union-attr]
            if not by_worker:
                del self._workers[entry.namespace]
                self._first.pop(entry.namespace, None)
