"""The shm transport's staging path (two copies), for receivers whose pool no sender can write:
the sender copies a message's pages into a ring region it owns (one per link, `StagingRing`),
names the part in the frame, and the receiver copies them out (`StagedPages`) and sends back a
``free`` credit for that part."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.kv_transfer._shm_memory import as_rows, ring_fit
from tandem.kv_transfer._shm_region import ShmRegion, is_region_name
from tandem.kv_transfer._socket_channel import FrameError, parse_dtype, parse_shape, send_frame

ALIGN = 64
"""Staged messages start on this many bytes."""


@dataclass(eq=False)
class StagingRing:
    """Sender side of one link: the region, and its parts the receiver has not freed yet."""

    region: ShmRegion | None = None
    data: np.ndarray | None = None
    outstanding: deque[tuple[int, int, int]] = field(default_factory=deque)  # seq, offset, size
    next_seq: int = 0

    def place(
        self,
        nbytes: int,
        min_bytes: int,
        create: Callable[[int], ShmRegion],
        drop: Callable[[ShmRegion], None],
    ) -> tuple[int, int] | None:
        """`(seq, offset)` of room for `nbytes`, (re)creating the region (`create(size)`,
        `drop(old)`) while nothing is outstanding and it is too small; None: wait for credits.
        Call holding the transport's lock."""
        size = -(-nbytes // ALIGN) * ALIGN
        region = self.region
        if region is None or region.size < size:
            if self.outstanding:
                return None
            if region is not None:
                drop(region)
            region = self.region = create(max(size, min_bytes))
            self.data = region.tensor(torch.uint8, (region.size,)).numpy()
            offset: int | None = 0
        else:
            offset = ring_fit(self.outstanding, region.size, size)
        if offset is None:
            return None
        seq = self.next_seq
        self.next_seq += 1
        self.outstanding.append((seq, offset, size))
        return seq, offset

    def free(self, seq: int) -> None:
        """The receiver copied message `seq` out (call holding the transport's lock)."""
        for i, entry in enumerate(self.outstanding):
            if entry[0] == seq:
                del self.outstanding[i]
                return


@dataclass(eq=False)
class StagedPages:
    """Receiver side of one connection: the peer's staging region, mapped on first use."""

    region: ShmRegion | None = None
    data: np.ndarray | None = None

    def take(self, pages: Any, sock: Any) -> torch.Tensor:
        """Copies the pages a frame's `pages` names out of the region and frees that part."""
        if not isinstance(pages, dict) or not is_region_name(pages.get("region")):
            raise FrameError(f"bad staged pages {pages!r}")
        offset, seq = pages.get("offset"), pages.get("seq")
        if not isinstance(offset, int) or not isinstance(seq, int):
            raise FrameError(f"bad staged pages {pages!r}")
        dtype = parse_dtype(pages.get("dtype"))
        shape = parse_shape(pages.get("shape"), 6)
        if self.region is None or self.region.name != pages["region"]:
            self.close()
            self.region = ShmRegion.attach(pages["region"], populate=True)
            self.data = self.region.tensor(torch.uint8, (self.region.size,)).numpy()
        out = torch.empty(shape, dtype=dtype)
        raw = as_rows(out.reshape(1, -1)).reshape(-1)
        if self.data is None or not 0 <= offset <= len(self.data) - raw.size:
            raise FrameError(f"staged pages {pages!r} lie outside the staging region")
        np.copyto(raw, self.data[offset : offset + raw.size])
        send_frame(sock, {"type": "free", "seq": seq})
        return out

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
        self.region = self.data = None
