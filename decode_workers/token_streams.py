"""The decode worker's token streams: each request's queue of items (`TokenStream`), items
queued together merged into one (`merge_token_items`), and a step's items handed to their event
loop in one call (`StreamOutbox`).

`loop.call_soon_threadsafe` writes to the loop's self-pipe each time: a step's tokens for 32
streams were 32 writes (syscalls) on the engine's thread and as many wake-ups of the loop,
which then contends with the engine for the process's GIL.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

_Pairs = list[tuple[asyncio.Queue[Any], Any]]


@dataclass
class TokenStream:
    """One request's stream of items on the decode worker: the queue its RPC call reads, on
    its event loop, and what the items report."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[dict[str, Any]]
    prompt_token_ids: list[int]
    params: SamplingParams
    reserved_at: float = field(default_factory=time.time)
    committed_at: float | None = None
    num_cached_tokens: int = 0
    num_transferred_blocks: int = 0
    local: bool = False
    request: Request | None = None
    counts_sent: bool = False  # its first item carried num_cached_tokens (usage so far)
    held: dict[str, Any] | None = None  # tokens gathered, not sent yet (`gathered`)

    def put(self, item: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def gathered(self, item: dict[str, Any], interval: int) -> dict[str, Any] | None:
        """`item` with the tokens held before it, once they number `interval` or it ends the
        stream; else None, and they are held (on the engine's thread: a stream interval)."""
        if self.held is not None:
            item, self.held = merge_token_items(self.held, item), None
        if len(item["token_ids"]) < interval and "finish_reason" not in item:
            self.held = item
            return None
        return item


def merge_token_items(item: dict[str, Any], nxt: dict[str, Any]) -> dict[str, Any]:
    """Two queued token items as one (the later one's fields, both items' tokens)."""
    merged = {
        **item,  # (the first item's counts, when it had them)
        **nxt,
        "token_ids": item["token_ids"] + nxt["token_ids"],
        "text": item["text"] + nxt["text"],
    }
    if "logprobs" in item or "logprobs" in nxt:
        merged["logprobs"] = item.get("logprobs", []) + nxt.get("logprobs", [])
    return merged


class StreamOutbox:
    """Collects (queue, item) pairs per event loop (`add`), then hands each loop its pairs in
    one call, in the order they were added (`flush`)."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, _Pairs] = {}

    def add(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], item: Any) -> None:
        self._pending.setdefault(loop, []).append((queue, item))

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, pairs in pending.items():
            loop.call_soon_threadsafe(_put_all, pairs)


def _put_all(pairs: _Pairs) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)
