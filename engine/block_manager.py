"""Paged KV block allocation with ref counts, a prefix cache, LRU eviction, pins and KV events.

Blocks `0..num_blocks-1` are each in exactly one state:

- in use: `ref_count > 0` (held by one or more requests' block tables) and/or pinned;
- free: `ref_count == 0` and not pinned; these sit in the free queue, oldest first.

A free block keeps its hash, so the prefix cache can still find it (and a hit takes it back out of
the free queue). New blocks come from the front of the free queue; only then is a cached block's
hash evicted (a "removed" event). Freed blocks go to the back, and `free` releases a table in reverse
order so a sequence's tail, the least likely part to be shared, is evicted before its head.

A pinned block (e.g. one being read or written by a KV transfer) is never handed out or evicted,
whatever its ref count. The manager is single-threaded; its owner calls `drain_events` each step.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

__all__ = ["BlockManager", "KVEvent", "PrefixCacheStats"]


class KVEvent(NamedTuple):
    """A block hash entered ("stored") or left ("removed") the prefix cache.

    `parent_hash` is the previous block's hash in the chain for "stored" events of blocks after the
    first; it is None for block 0 (whose parent is the namespace root) and for "removed" events.
    """

    kind: Literal["stored", "removed"]
    block_hash: int
    parent_hash: int | None
    block_id: int


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters of `match_prefix` (calls, full blocks asked for, blocks found) and of cached
    blocks evicted to make room."""

    queries: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class _Block:
    __slots__ = ("block_id", "block_hash", "pin_count", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.pin_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept with the hash, for the collision guard


class BlockManager:
    """Owns the KV block ids of one worker; see the module docstring for the states."""

    __slots__ = (
        "_block_size",
        "_blocks",
        "_enable_kv_events",
        "_enable_prefix_caching",
        "_events",
        "_free_queue",
        "_hash_to_block",
        "_stats",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        enable_kv_events: bool = True,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self._block_size = block_size
        self._enable_prefix_caching = enable_prefix_caching
        self._enable_kv_events = enable_kv_events
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Keys are block ids of free blocks, front = least recently freed; values are unused.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._events: list[KVEvent] = []
        self._stats = PrefixCacheStats()

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` may hand out, including free blocks that still hold a hash."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_count > 0 or pinned)."""
        return 1.0 - len(self._free_queue) / len(self._blocks)

    @property
    def enable_prefix_caching(self) -> bool:
        return self._enable_prefix_caching

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the prefix-cache counters."""
        s = self._stats
        return PrefixCacheStats(s.queries, s.queried_blocks, s.hit_blocks, s.evicted_blocks)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def pin_count(self, block_id: int) -> int:
        return self._blocks[block_id].pin_count

    def cached_hash(self, block_id: int) -> int | None:
        """The hash under which the block is in the prefix cache, or None."""
        return self._blocks[block_id].block_hash

    # ---- prefix cache ------------------------------------------------------------------------

    def match_prefix(
        self, block_hashes: Sequence[int], token_ids: Sequence[int], *, record: bool = True
    ) -> list[int]:
        """Block ids of the longest cached prefix of full blocks; takes no references.

        `block_hashes` is the request's chain of full-block hashes and `token_ids` its tokens. A
        block matches only if its hash is cached and its stored tokens equal the request's tokens
        for that block (a guard against hash collisions). The ids stay valid only until the next
        `allocate` for another request; the caller passes (a prefix of) them to `allocate` as
        `computed_blocks`, and may drop the last one to leave a token to compute.
        `record=False` leaves the hit counters alone (a caller that may look the same request
        up again, like the scheduler, records once with `record_lookup`).
        """
        if not self._enable_prefix_caching:
            return []
        bs = self._block_size
        num_full = min(len(block_hashes), len(token_ids) // bs)
        hits: list[int] = []
        for i in range(num_full):
            block_id = self._hash_to_block.get(block_hashes[i])
            if block_id is None:
                break
            if self._blocks[block_id].token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        if record:
            self.record_lookup(num_full, len(hits))
        return hits

    def record_lookup(self, queried_blocks: int, hit_blocks: int) -> None:
        """Counts one prefix-cache lookup of `queried_blocks` full blocks, `hit_blocks` found."""
        self._stats.queries += 1
        self._stats.queried_blocks += queried_blocks
        self._stats.hit_blocks += hit_blocks

    def cache_blocks(
        self,
        block_table: Sequence[int],
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        num_cached_blocks: int,
    ) -> int:
        """Register the hashes of full blocks `num_cached_blocks..len(block_hashes)-1`.

        `block_hashes` is the chain of the request's full, computed blocks (their KV is written).
        If a hash is already cached under another block (the same prefix computed concurrently),
        the existing entry wins and this block stays uncached. Records a "stored" event per new
        entry. Returns the new `num_cached_blocks`, i.e. `len(block_hashes)`.
        """
        num_full = len(block_hashes)
        if not self._enable_prefix_caching:
            return num_full
        bs = self._block_size
        if num_full > len(block_table) or num_full * bs > len(token_ids):
            raise ValueError(
                f"{num_full} block hashes for a table of {len(block_table)} blocks "
                f"and {len(token_ids)} tokens"
            )
        blocks = self._blocks
        hash_to_block = self._hash_to_block
        for i in range(num_cached_blocks, num_full):
            block = blocks[block_table[i]]
            block_hash = block_hashes[i]
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise RuntimeError(
                        f"block {block.block_id} is cached as {block.block_hash:#x}, "
                        f"not {block_hash:#x}"
                    )
                continue  # a prefix hit, already cached
            if block_hash in hash_to_block:
                continue  # a duplicate: keep the existing entry
            hash_to_block[block_hash] = block.block_id
            block.block_hash = block_hash
            block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            if self._enable_kv_events:
                parent = block_hashes[i - 1] if i > 0 else None
                self._events.append(KVEvent("stored", block_hash, parent, block.block_id))
        return num_full

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of all free blocks (blocks in use keep theirs); returns how many."""
        dropped = 0
        for block_id in self._free_queue:
            if self._blocks[block_id].block_hash is not None:
                self._evict(self._blocks[block_id])
                dropped += 1
        return dropped

    def forget(self, block_ids: Iterable[int]) -> int:
        """Drops the prefix-cache hashes of `block_ids`, in use or free (their pages are no
        longer what was computed for them); returns how many had one."""
        dropped = 0
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def drain_events(self) -> list[KVEvent]:
        """The KV events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- allocation --------------------------------------------------------------------------

    def can_allocate(self, num_new_blocks: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether `num_new_blocks` fresh blocks are available after taking `computed_blocks`."""
        free_queue = self._free_queue
        reserved = sum(1 for b in computed_blocks if b in free_queue)
        return num_new_blocks <= len(free_queue) - reserved

    def allocate(
        self, block_table: list[int], num_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow `block_table` in place to hold `num_tokens` tokens; all or nothing.

        If `block_table` is empty, first takes a reference on each of `computed_blocks` (prefix
        hits from `match_prefix`, taking them out of the free queue) and appends them; otherwise
        `computed_blocks` is ignored. Then appends blocks from the front of the free queue
        (evicting their hashes) until `len(block_table) * block_size >= num_tokens`. Returns False,
        changing nothing, if there are not enough free blocks.
        """
        if block_table:
            computed_blocks = ()
        num_needed = -(-num_tokens // self._block_size) - len(block_table) - len(computed_blocks)
        if num_needed > 0 and not self.can_allocate(num_needed, computed_blocks):
            return False
        blocks = self._blocks
        free_queue = self._free_queue
        for block_id in computed_blocks:
            if blocks[block_id].block_hash is None:
                raise RuntimeError(f"computed block {block_id} was evicted after match_prefix")
        for block_id in computed_blocks:
            block = blocks[block_id]
            if block.ref_count == 0 and block.pin_count == 0:
                del free_queue[block_id]
            block.ref_count += 1
            block_table.append(block_id)
        for _ in range(num_needed):
            block_id, _unused = free_queue.popitem(last=False)
            block = blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block_table.append(block_id)
        return True

    def free(self, block_table: Sequence[int]) -> None:
        """Drop one reference on each block, tail first; blocks reaching 0 join the free queue.

        Raises RuntimeError (changing nothing) if a block has no reference to drop.
        """
        blocks = self._blocks
        for block_id in block_table:
            if blocks[block_id].ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
        free_queue = self._free_queue
        for block_id in reversed(block_table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0 and block.pin_count == 0:
                free_queue[block_id] = None

    def pin(self, block_ids: Iterable[int]) -> None:
        """Keep blocks from being handed out or evicted until unpinned (pins nest)."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0 and block.pin_count == 0:
                del self._free_queue[block_id]
            block.pin_count += 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Undo one `pin` per id; a block left unreferenced goes to the back of the free queue.

        Raises RuntimeError (changing nothing) if a block has fewer pins than requested.
        """
        counts = Counter(block_ids)
        for block_id, count in counts.items():
            if self._blocks[block_id].pin_count < count:
                raise RuntimeError(f"unpin of block {block_id}, which is not pinned")
        for block_id, count in counts.items():
            block = self._blocks[block_id]
            block.pin_count -= count
            if block.pin_count == 0 and block.ref_count == 0:
                self._free_queue[block_id] = None

    def _evict(self, block: _Block) -> None:
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        self._stats.evicted_blocks += 1
        if self._enable_kv_events:
            self._events.append(KVEvent("removed", block.block_hash, None, block.block_id))
        block.block_hash = None
        block.token_ids = None

    # ---- checks ------------------------------------------------------------------------------

    def check_integrity(self, block_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise RuntimeError listing every broken invariant (for tests and debug runs).

        Checks that the free queue holds exactly the unreferenced, unpinned blocks; that the hash
        map and the per-block hashes agree; and, if `block_tables` is given (all live tables), that
        each block's ref count equals the number of tables holding it.
        """
        errors: list[str] = []
        n = len(self._blocks)
        errors += [
            f"free queue holds unknown block {b}" for b in self._free_queue if not 0 <= b < n
        ]
        for block in self._blocks:
            b = block.block_id
            if block.ref_count < 0 or block.pin_count < 0:
                errors.append(
                    f"block {b}: ref_count {block.ref_count}, pin_count {block.pin_count}"
                )
            should_be_free = block.ref_count == 0 and block.pin_count == 0
            if should_be_free and b not in self._free_queue:
                errors.append(f"block {b} is unreferenced and unpinned but not in the free queue")
            if not should_be_free and b in self._free_queue:
                errors.append(
                    f"block {b} is in the free queue with ref_count {block.ref_count}, "
                    f"pin_count {block.pin_count}"
                )
            if block.block_hash is not None:
                if self._hash_to_block.get(block.block_hash) != b:
                    errors.append(f"block {b} has hash {block.block_hash:#x} not mapped to it")
                if block.token_ids is None or len(block.token_ids) != self._block_size:
                    errors.append(f"cached block {b} has no full token tuple")
            elif block.token_ids is not None:
                errors.append(f"uncached block {b} keeps token ids")
        for block_hash, b in self._hash_to_block.items():
            if not 0 <= b < n or self._blocks[b].block_hash != block_hash:
                errors.append(f"hash {block_hash:#x} maps to block {b}, which has another hash")
        if self._hash_to_block and not self._enable_prefix_caching:
            errors.append("prefix caching is disabled but the hash map is not empty")
        if block_tables is not None:
            holders = Counter(b for table in block_tables for b in table)
            for block in self._blocks:
                if block.ref_count != holders[block.block_id]:
                    errors.append(
                        f"block {block.block_id} has ref_count {block.ref_count} "
                        f"but is in {holders[block.block_id]} block tables"
                    )
        if errors:
            raise RuntimeError("block manager integrity check failed: " + "; ".join(errors))
