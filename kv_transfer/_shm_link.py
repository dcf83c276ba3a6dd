"""What one link of the shm transport knows on each side (see `shm.py`).

Sender side (`LinkState`): where the peer's pool is, if it announced one (mapped from its
shared-memory region, or a private pool written by cross-memory attach), the cross-memory
writes queued for the next flush, the pull path's ring where the peer took it, and the staging
ring. Receiver side (`ConnState`): the peer's staging ring, mapped on first use, and the pull
path's reader where it was offered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _cross_memory, _shm_pull
from tandem.kv_transfer._shm_memory import Rows, as_rows, copy_rows
from tandem.kv_transfer._shm_region import ShmRegion, is_region_name
from tandem.kv_transfer._shm_staging import StagedPages, StagingRing
from tandem.kv_transfer._socket_channel import (
    FrameError,
    consecutive_runs,
    parse_dtype,
    parse_shape,
    valid_block_ids,
)
from tandem.kv_transfer.manifest import TransferError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LinkState:
    """Sender side of a link: the peer's pool (mapped, or where to write it by cross-memory
    attach) if it announced one, and this link's staging ring."""

    peer_region: ShmRegion | None = None
    peer_pool: torch.Tensor | None = None
    peer_rows: Rows = None
    target: _cross_memory.RemotePool | None = None  # a private pool, written by cross-memory
    pending_runs: list[tuple[int, int, int]] = field(default_factory=list)  # written at flush
    pull: _shm_pull.PullWriter | None = None  # the pull path's ring, where the peer took it
    staging: StagingRing = field(default_factory=StagingRing)

    def attach(self, pool: Any, peer: str, sock: Any, who: str) -> None:
        """Takes the pool the peer's welcome announced (None: it stages)."""
        if pool is None:
            return
        if not isinstance(pool, dict):
            raise FrameError(f"{peer} announced a bad pool {pool!r}")
        if "pid" in pool:  # private memory: written by cross-memory attach where allowed
            self.target = _cross_memory.remote_pool(pool, sock)
            if self.target is None:
                log.warning("%s: cannot write into the pool of %s: staging", who, peer)
            return
        if not is_region_name(pool.get("region")):
            raise FrameError(f"{peer} announced a bad pool {pool!r}")
        num_blocks = parse_shape([pool.get("num_blocks")], 1)[0]
        shape = (num_blocks, *parse_shape(pool.get("block_shape"), 5))
        region = ShmRegion.attach(pool["region"], populate=True)
        self.peer_region = region
        self.peer_pool = region.tensor(parse_dtype(pool.get("dtype")), shape)
        self.peer_rows = as_rows(self.peer_pool)

    def detach(self) -> None:
        """Lets go of the peer's mapped pool."""
        self.peer_pool = self.peer_rows = None
        if self.peer_region is not None:
            self.peer_region.close()

    def write_across(self, pool: KVCachePool, src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
        """Queues the pages of `src` for `dst` in the peer's private pool: `flush_across` writes
        them by cross-memory attach, before the frames that announce them. False where the
        pools do not match (the message is staged)."""
        target = self.target
        assert target is not None
        if len(dst) != len(src) or not target.matches(pool):
            return False
        if not valid_block_ids(dst, target.num_blocks):
            return False
        self.pending_runs += target.runs(pool.tensor.data_ptr(), src, dst)
        return True

    def flush_across(self, peer: str) -> None:
        """Writes the pages queued for the peer's private pool (one system call for the batch)."""
        if not self.pending_runs:
            return
        runs, self.pending_runs = self.pending_runs, []
        assert self.target is not None
        try:
            _cross_memory.write(self.target.pid, runs)
        except OSError as exc:
            raise TransferError(f"could not write pages into {peer}: {exc}") from None

    def write_mapped(
        self, pool: KVCachePool, rows: Rows, src: tuple[int, ...], dst: tuple[int, ...]
    ) -> bool:
        """Copies the pages of `src` to `dst` in the peer's mapped pool; False where it has none
        or it does not match (the message is staged)."""
        peer_pool, peer_rows = self.peer_pool, self.peer_rows
        if (
            peer_pool is None
            or len(dst) != len(src)
            or tuple(peer_pool.shape[1:]) != pool.block_shape
            or peer_pool.dtype != pool.dtype
            or not valid_block_ids(dst, peer_pool.shape[0])
        ):
            return False
        for s, d, n in consecutive_runs(src, dst):
            copy_rows(peer_rows[d : d + n], rows[s : s + n])
        return True


@dataclass(eq=False)
class ConnState:
    """Receiver side of a connection: the peer's staging ring, mapped on first use."""

    staging: StagedPages = field(default_factory=StagedPages)
    reader: _shm_pull.PullReader | None = None  # the pull path's reader, where offered
