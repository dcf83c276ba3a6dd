"""What the UCX transport keeps per message, link and incoming connection (see `ucx.py`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch


def _run_start(ids: Any) -> int | None:  # the first id of a list that is one run of ints
    if isinstance(ids, list) and ids and all(isinstance(b, int) for b in ids):
        return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
    return None


@dataclass
class _Out:
    header: dict[str, Any]
    block_ids: list[int]
    requests: list[Any] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # buffers UCX reads until completion
    staging: torch.Tensor | None = None
    deadline: float = 0.0


@dataclass
class _Link:
    ep: Any
    watch: Any  # idle endpoint with UCX error handling: `alive` turns False when the peer dies
    conn: int
    deadline: float  # for the welcome
    welcomed: bool = False
    queue: deque[_Out] = field(default_factory=deque)
    inflight: deque[_Out] = field(default_factory=deque)
    seq: int = 0
    spare: torch.Tensor | None = None  # a staging buffer to reuse

    def settled(self) -> bool:
        """No send of this link's is still in UCX's hands."""
        return all(r.completed for out in self.inflight for r in out.requests)


@dataclass
class _Rx:
    header: dict[str, Any]
    deadline: float = 0.0
    pages: torch.Tensor | None = None
    request: Any = None
    direct: bool = False
    failed: str | None = None


@dataclass
class _Conn:
    state: str = "hello"  # -> "ok" | "refused"
    peer: str = ""
    rx: deque[_Rx] = field(default_factory=deque)
