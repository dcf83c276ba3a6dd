"""Memory helpers of the shm transport: block rows as raw bytes, the staging ring's free space,
and the regions and socket file an endpoint must remove when it goes away."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from typing import Any

import numpy as np
import torch

from tandem.kv_transfer._shm_region import ShmRegion

Rows = Any
"""Blocks as rows of raw bytes: a numpy ``(n, bytes)`` view on CPU, a uint8 tensor elsewhere."""


def as_rows(t: torch.Tensor) -> Rows:
    """`t`'s first dimension as rows of raw bytes (a view; numpy on CPU, so copies are one
    single-threaded memcpy each with no torch dispatch overhead)."""
    rows = t.view(torch.uint8).reshape(t.shape[0], -1)
    return rows.numpy() if rows.device.type == "cpu" else rows


def copy_rows(dst: Rows, src: Rows) -> None:
    """`dst[...] = src` for equal-shape row blocks from `as_rows`."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        as_tensor = torch.from_numpy
        d = as_tensor(dst) if isinstance(dst, np.ndarray) else dst
        d.copy_(as_tensor(src) if isinstance(src, np.ndarray) else src)


class Owned:
    """What an endpoint must remove when it goes away (kept apart from it for the finalizer)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.regions: dict[str, ShmRegion] = {}

    def drop(self, name: str) -> None:
        region = self.regions.pop(name, None)
        if region is not None:
            region.unlink()
            region.close()

    def release(self) -> None:
        for name in list(self.regions):
            self.drop(name)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)


def ring_fit(outstanding: deque[tuple[int, int, int]], capacity: int, size: int) -> int | None:
    """Where `size` bytes fit in a ring whose in-use ranges are `outstanding` (FIFO order)."""
    if not outstanding:
        return 0 if size <= capacity else None
    first = outstanding[0][1]
    _, last_off, last_size = outstanding[-1]
    end = last_off + last_size
    if last_off >= first:  # not wrapped: free space is [end, capacity) and [0, first)
        if end + size <= capacity:
            return end
        return 0 if size <= first else None
    return end if end + size <= first else None
