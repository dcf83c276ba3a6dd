"""The shm transport's KV pools: which kind of memory each pool an endpoint allocated lives in,
and what the endpoint's welcome announces of its registered pool so peers can write into it.

Kinds: private memory on transparent huge pages, either send-only (a prefill worker's, which
peers may read on the pull path) or written by peers with cross-memory attach; or a named POSIX
shared-memory region of the endpoint, which peers map.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer._hugepages import allocate_hugepage_pool
from tandem.kv_transfer._shm_memory import Owned
from tandem.kv_transfer._shm_region import ShmRegion
from tandem.kv_transfer._socket_channel import dtype_name


class PoolKinds:
    """Allocates pools and remembers their kind, by the address of their memory."""

    def __init__(self, owned: Owned, region_name: Callable[[str], str]) -> None:
        self._owned = owned  # (regions it creates are removed with the endpoint)
        self._region_name = region_name
        self._send_only: set[int] = set()
        self._private: set[int] = set()  # written by peers with cross-memory attach
        self._regions: dict[int, str] = {}  # -> the shared-memory region's name

    def allocate(
        self,
        shape: tuple[int, int, int, int, int],
        dtype: torch.dtype,
        *,
        send_only: bool,
        cross_memory: bool,
    ) -> KVCachePool:
        """A zero-filled pool of `shape` (num_blocks, num_layers, block_size, num_kv_heads,
        head_dim): private huge-page memory for `send_only` or `cross_memory`, else a region."""
        if send_only or cross_memory:
            pool = allocate_hugepage_pool(*shape, dtype)
            (self._send_only if send_only else self._private).add(pool.tensor.data_ptr())
            return pool
        region = ShmRegion.create(self._region_name("p"), KVCachePool.bytes_for(*shape, dtype))
        self._owned.regions[region.name] = region
        tensor = region.tensor(dtype, KVCachePool.shape_for(*shape))
        tensor.view(torch.uint8).reshape(-1).numpy().fill(0)  # touch every page once, now
        self._regions[tensor.data_ptr()] = region.name
        return KVCachePool(*shape, dtype, tensor=tensor)

    def is_send_only(self, pool: KVCachePool | None) -> bool:
        return pool is not None and pool.tensor.data_ptr() in self._send_only

    def announcement(self, pool: KVCachePool) -> dict[str, Any] | None:
        """What a welcome tells peers of `pool` so they write into it (None: they stage)."""
        ptr = pool.tensor.data_ptr()
        geometry = {
            "num_blocks": pool.num_blocks,
            "block_shape": list(pool.block_shape),
            "dtype": dtype_name(pool.dtype),
        }
        if ptr in self._private:
            return {"pid": os.getpid(), "address": ptr, **geometry}
        if ptr in self._regions and pool.device.type == "cpu":
            return {"region": self._regions[ptr], **geometry}
        return None
