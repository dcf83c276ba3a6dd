"""The router's exact prefix index, fed by the workers' KV events (DESIGN §3, §6; issue 5).

Each worker publishes `KVEventBatch`es: the block hashes that entered ("stored") or left
("removed") its prefix cache in one cache namespace, numbered by a per-worker sequence number
`seq` (0, 1, 2, ... over all of the worker's namespaces). The index keeps, per namespace, the set
of hashes each worker holds, and answers "how many leading blocks of this hash chain does each
worker hold" (`match`).

Sequence rules (per worker):

- A worker's stream starts at `seq == 0` (with an empty cache) or with a snapshot.
- A non-snapshot batch must have `seq == last + 1`. A larger `seq` is a gap (a batch was lost or
  reordered): the worker becomes *stale*, its entries are dropped, and batches other than
  snapshots are ignored until a snapshot arrives (`needs_snapshot` says so). A smaller `seq` is a
  duplicate or a late batch and is ignored.
- A snapshot batch (`snapshot=True`, `seq > last`) replaces everything the index had for the
  worker, in every namespace, by `stored` in `namespace` and clears staleness. A worker with blocks
  in several namespaces sends the snapshot for one, then ordinary batches (next `seq`s) with the
  `stored` hashes of the others.
- A batch may say how many hashes the worker holds in its namespace after it and their XOR
  (`held`, `digest`). Where the index's copy differs (a lost or mangled change that the sequence
  did not show), the worker becomes stale as after a gap, and the caller asks for a snapshot.
- Within a batch `removed` is applied before `stored`; `KVEventBatch.from_kv_events` coalesces an
  ordered event list so that each hash appears in at most one of the two lists.

A restarted worker must come back under a new id, or the router calls `remove_worker` first.
Hashes of different namespaces never mix: the same integer in two namespaces is two blocks.
The index is single-threaded and does no I/O: calls are short and never block an event loop.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import takewhile

from pydantic import BaseModel, ConfigDict

from tandem.engine.block_manager import KVEvent
from tandem.engine.kv_event_publisher import coalesce, stored_and_removed

__all__ = ["KVEventBatch", "PrefixIndex"]


class KVEventBatch(BaseModel):
    """One worker's prefix-cache changes in one namespace; JSON-able, it travels over the wire.

    `namespace` is the cache namespace's digest (`CacheNamespace.digest()`), or any string that
    router and worker agree on. `snapshot=True` means `stored` is the worker's full set (see the
    module docstring for what that replaces).
    """

    model_config = ConfigDict(extra="forbid")

    worker_id: str
    seq: int
    namespace: str
    stored: list[int] = []
    removed: list[int] = []
    snapshot: bool = False
    held: int | None = None  # hashes the worker holds in `namespace` after this batch
    digest: int | None = None  # their XOR

    @classmethod
    def from_kv_events(
        cls, worker_id: str, seq: int, namespace: str, events: Iterable[KVEvent]
    ) -> KVEventBatch:
        """A batch from `BlockManager.drain_events()` output, oldest first, coalesced as a
        worker's publisher does (`coalesce`: a hash's last event decides its list)."""
        last: dict[int, bool] = {}
        coalesce(last, events)
        stored, removed = stored_and_removed(last)
        return cls(
            worker_id=worker_id,
            seq=seq,
            namespace=namespace,
            stored=stored,
            removed=removed,
        )


class _Worker:
    __slots__ = ("bit", "digests", "last_seq", "sets", "stale")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.last_seq = -1
        self.stale: str | None = None  # why it is distrusted: "gap", "digest" or "marked"
        self.sets: dict[str, set[int]] = {}  # namespace -> block hashes held
        self.digests: dict[str, int] = {}  # namespace -> XOR of its hashes held


class PrefixIndex:
    """Per worker and namespace, the block hashes it holds; longest-prefix match over workers.

    Layout: each known worker owns one bit; per namespace, `hash -> bitmask of holders` finds the
    workers holding a chain's first block in O(1), and each such worker's own hash set gives its
    matched length by walking the chain until the first miss, in C (`itertools.takewhile`).
    """

    __slots__ = ("_free_bits", "_holders", "_names", "_sets_by_bit", "_trusted", "_workers")

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._names: dict[int, str] = {}  # bit index -> worker id
        self._free_bits: list[int] = []
        self._trusted = 0  # bitmask of known, non-stale workers
        self._holders: dict[str, dict[int, int]] = {}  # namespace -> hash -> holder bitmask
        # namespace -> bit index -> that worker's hash set (the same set objects as _Worker.sets)
        self._sets_by_bit: dict[str, dict[int, set[int]]] = {}

    # ---- updates -----------------------------------------------------------------------------

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one batch; True if applied, False if ignored (gap, duplicate, stale worker) or
        if the worker's own count and digest of its hashes disagree with the index's copy.

        A gap or a disagreement marks the worker stale until a snapshot arrives (see the module
        docstring).
        """
        worker = self._workers.get(batch.worker_id)
        if worker is None:
            worker = self._add_worker(batch.worker_id)
        if batch.snapshot:
            if batch.seq <= worker.last_seq:
                return False  # an old snapshot, overtaken by newer batches
            worker.stale = None
            self._trusted |= 1 << worker.bit
            worker.last_seq = batch.seq
            self._replace(worker, batch.namespace, batch.stored)
            return True  # (it is the worker's whole set: its count and digest say nothing more)
        if worker.stale is not None or batch.seq <= worker.last_seq:
            return False
        elif batch.seq != worker.last_seq + 1:
            self._mark_stale(worker, "gap")
            return False
        worker.last_seq = batch.seq
        self._update(worker, batch.namespace, batch.stored, batch.removed)
        return self._agrees(worker, batch)

    def mark_stale(self, worker_id: str) -> None:
        """Distrust a worker until its next snapshot (e.g. its event stream was reset)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = self._add_worker(worker_id)
        self._mark_stale(worker, "marked")

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that died or left; unknown ids are ignored."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._clear(worker)
        self._trusted &= ~(1 << worker.bit)
        del self._names[worker.bit]
        self._free_bits.append(worker.bit)

    # ---- queries -----------------------------------------------------------------------------

    def needs_snapshot(self, worker_id: str) -> bool:
        """Whether the worker is stale (no snapshot has arrived since `stale_reason`)."""
        return self.stale_reason(worker_id) is not None

    def stale_reason(self, worker_id: str) -> str | None:
        """Why the worker is stale: "gap" (in its sequence), "digest" (a batch's count and
        digest disagreed with the index's) or "marked" (`mark_stale`); None when trusted."""
        worker = self._workers.get(worker_id)
        return worker.stale if worker is not None else None

    def workers(self) -> set[str]:
        """Every known worker, stale ones included."""
        return set(self._workers)

    def num_blocks(self, worker_id: str, namespace: str | None = None) -> int:
        """How many hashes the index holds for a worker (in one namespace, or in all)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        if namespace is not None:
            return len(worker.sets.get(namespace, ()))
        return sum(len(s) for s in worker.sets.values())

    def match(
        self,
        namespace: str,
        block_hashes: Sequence[int],
        workers: Iterable[str] | None = None,
    ) -> dict[str, int]:
        """Worker -> number of leading blocks of `block_hashes` it holds (longest prefix).

        Only non-stale workers (and, if `workers` is given, only those) are considered; workers
        with no leading block are left out of the result. Cost: O(1) to find the workers holding
        block 0, then O(matched blocks + 1) per such worker.
        """
        if not block_hashes:
            return {}
        holders = self._holders.get(namespace)
        if holders is None:
            return {}
        mask = holders.get(block_hashes[0], 0) & self._trusted
        if not mask:
            return {}
        if workers is not None:
            allowed = 0
            for worker_id in workers:
                worker = self._workers.get(worker_id)
                if worker is not None:
                    allowed |= 1 << worker.bit
            mask &= allowed
        sets = self._sets_by_bit[namespace]
        names = self._names
        result: dict[str, int] = {}
        while mask:
            low = mask & -mask
            mask ^= low
            bit = low.bit_length() - 1
            result[names[bit]] = len(list(takewhile(sets[bit].__contains__, block_hashes)))
        return result

    # ---- internals ---------------------------------------------------------------------------

    def _add_worker(self, worker_id: str) -> _Worker:
        bit = self._free_bits.pop() if self._free_bits else len(self._names)
        worker = _Worker(bit)
        self._workers[worker_id] = worker
        self._names[bit] = worker_id
        self._trusted |= 1 << bit
        return worker

    def _agrees(self, worker: _Worker, batch: KVEventBatch) -> bool:
        """Whether the worker's count and digest (where the batch has them) are the index's."""
        if batch.held is None or batch.digest is None:
            return True
        ours = (len(worker.sets.get(batch.namespace, ())), worker.digests.get(batch.namespace, 0))
        if ours == (batch.held, batch.digest):
            return True
        self._mark_stale(worker, "digest")
        return False

    def _mark_stale(self, worker: _Worker, why: str) -> None:
        self._clear(worker)
        worker.stale = why
        self._trusted &= ~(1 << worker.bit)

    def _update(
        self, worker: _Worker, namespace: str, stored: Collection[int], removed: Collection[int]
    ) -> None:
        held = worker.sets.get(namespace)
        if held is None:
            if not stored:
                return
            held = worker.sets[namespace] = set()
            self._sets_by_bit.setdefault(namespace, {})[worker.bit] = held
        holders = self._holders.setdefault(namespace, {})
        bit = 1 << worker.bit
        digest = worker.digests.get(namespace, 0)
        for block_hash in removed:
            if block_hash in held:
                held.discard(block_hash)
                digest ^= block_hash
                rest = holders[block_hash] & ~bit
                if rest:
                    holders[block_hash] = rest
                else:
                    del holders[block_hash]
        for block_hash in stored:
            if block_hash not in held:
                held.add(block_hash)
                digest ^= block_hash
                holders[block_hash] = holders.get(block_hash, 0) | bit
        worker.digests[namespace] = digest
        if not held:
            self._drop_namespace(worker, namespace)

    def _replace(self, worker: _Worker, namespace: str, stored: Sequence[int]) -> None:
        """What `worker` holds becomes `stored` in `namespace` (nothing elsewhere). Only the
        difference goes through the holders: a resync's snapshot of a full cache (30k hashes)
        is mostly what the index has already (8 ms to clear and refill, here)."""
        for other in [ns for ns in worker.sets if ns != namespace]:
            self._forget(worker, other)
        new = set(stored)
        held = worker.sets.get(namespace, set())
        self._update(worker, namespace, new - held, held - new)

    def _clear(self, worker: _Worker) -> None:
        for namespace in list(worker.sets):
            self._forget(worker, namespace)

    def _forget(self, worker: _Worker, namespace: str) -> None:
        self._update(worker, namespace, (), list(worker.sets[namespace]))
        self._drop_namespace(worker, namespace)

    def _drop_namespace(self, worker: _Worker, namespace: str) -> None:
        worker.digests.pop(namespace, None)
        if worker.sets.pop(namespace, None) is None:
            return
        by_bit = self._sets_by_bit[namespace]
        del by_bit[worker.bit]
        if not by_bit:
            del self._sets_by_bit[namespace]
            del self._holders[namespace]
