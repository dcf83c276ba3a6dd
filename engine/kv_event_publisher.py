"""A worker's prefix-cache events, sequenced and batched for the router's index (issue 5).

The engine's block manager records "stored" / "removed" block hashes; the worker loop hands them
to `collect` after every step. `take_batch` turns what accumulated into one numbered batch; a
subscriber that sees a gap in the numbers asks again and first gets a `snapshot` (the full set of
hashes this worker caches, numbered like any batch and sent to every subscriber), so a lost or
reordered batch is detected and repaired. Snapshots also go out periodically. Batches are plain dicts (JSON over the RPC channel),
with the fields of `tandem.router.prefix_index.KVEventBatch`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tandem.engine.block_manager import KVEvent


class KVEventPublisher:
    def __init__(self, worker_id: str, namespace: str) -> None:
        self.worker_id = worker_id
        self.namespace = namespace
        self.seq = 0
        self.cached: set[int] = set()
        self._stored: list[int] = []
        self._removed: list[int] = []

    def collect(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if event.kind == "stored":
                self.cached.add(event.block_hash)
                self._stored.append(event.block_hash)
            else:
                self.cached.discard(event.block_hash)
                self._removed.append(event.block_hash)

    @property
    def pending(self) -> bool:
        return bool(self._stored or self._removed)

    def take_batch(self) -> dict[str, Any] | None:
        """The events since the last batch, as batch `seq + 1`; None when there are none."""
        if not self.pending:
            return None
        self.seq += 1
        batch = self._batch(stored=self._stored, removed=self._removed, snapshot=False)
        self._stored, self._removed = [], []
        return batch

    def snapshot(self) -> dict[str, Any]:
        """Everything cached now, as batch `seq + 1` (take pending events first)."""
        self.seq += 1
        return self._batch(stored=sorted(self.cached), removed=[], snapshot=True)

    def _batch(self, *, stored: list[int], removed: list[int], snapshot: bool) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "seq": self.seq,
            "namespace": self.namespace,
            "stored": stored,
            "removed": removed,
            "snapshot": snapshot,
        }
