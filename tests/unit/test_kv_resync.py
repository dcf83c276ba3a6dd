"""The router re-reads a worker's prefix cache (a new subscription starts with a snapshot) when
its KV events have a gap or a batch's count and digest differ from the index's copy, and
counts each resync by reason."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tandem.router.worker_directory import Worker, WorkerDirectory


def _batch(seq: int, stored: list[int], *, snapshot: bool = False, **extra: Any) -> dict[str, Any]:
    return {"worker_id": "decode/a", "seq": seq, "namespace": "ns", "stored": stored,
            "removed": [], "snapshot": snapshot, **extra}  # fmt: skip


class _Client:
    """A worker's RPC client whose `kv_events` subscriptions replay scripted batches."""

    def __init__(self, subscriptions: list[list[dict[str, Any]]]) -> None:
        self.subscriptions = subscriptions
        self.closed = False
        self.opened = 0

    async def stream(self, method: str) -> AsyncIterator[dict[str, Any]]:
        assert method == "kv_events"
        batches = self.subscriptions[self.opened]
        self.opened += 1
        if self.opened == len(self.subscriptions):
            self.closed = True  # (the loop ends after the last one)
        for batch in batches:
            yield batch


def test_a_gap_or_a_disagreeing_digest_resubscribes_and_is_counted() -> None:
    client = _Client(
        [
            [
                _batch(1, [1, 2], snapshot=True),
                _batch(2, [4], held=3, digest=1 ^ 2 ^ 4),
                _batch(3, [8], held=4, digest=1 ^ 2 ^ 4 ^ 16),  # the index has 8, not 16
                _batch(4, [32]),  # (not read: the router resubscribes first)
            ],
            [
                _batch(5, [1, 2, 4, 16], snapshot=True, held=4, digest=1 ^ 2 ^ 4 ^ 16),
                _batch(7, [64]),
            ],  # a gap  # fmt: skip
            [_batch(8, [1, 2], snapshot=True)],
        ]
    )
    directory = WorkerDirectory(registry=None, auth_token="t")
    worker = Worker("decode/a", "decode", client)  # type: ignore[arg-type]
    resyncs: list[tuple[str, str]] = []
    directory.on_kv_resync.append(lambda role, reason: resyncs.append((role, reason)))
    asyncio.run(asyncio.wait_for(directory._follow_kv_events(worker), 5))
    assert resyncs == [("decode", "digest"), ("decode", "gap")]
    assert client.opened == 3
    assert directory.index.match("ns", [1, 2]) == {"decode/a": 2}
    assert directory.index.num_blocks("decode/a") == 2
