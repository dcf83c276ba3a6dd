"""The paged KV-cache pool: one tensor, allocated once, block-major.

Layout
------
``pool.tensor`` has shape ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``
(index 0 of the third dim is K, 1 is V) and is C-contiguous. Consequences:

* the KV of one block for *all* layers is one contiguous byte range of ``bytes_per_block``
  bytes (``block_view``/``as_bytes``) -- this is the unit moved between processes by KV
  transfer (``export_blocks``/``import_blocks``);
* the per-layer caches returned by ``layer_cache`` are strided views of shape
  ``(num_blocks, block_size, num_kv_heads, head_dim)`` whose block stride is
  ``num_layers * 2 * block_size * num_kv_heads * head_dim`` elements; the inner
  ``(block_size, num_kv_heads, head_dim)`` dims are contiguous. ``(num_blocks, block_size)``
  cannot be merged into one dim as a view, which is why ``write_kv`` indexes with
  ``(slot // block_size, slot % block_size)`` pairs.

A *slot* is ``block_id * block_size + offset``; ``num_blocks * block_size`` slots exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["KVCachePool", "num_blocks_for_memory"]


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def num_blocks_for_memory(
    bytes_budget: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> int:
    """The largest number of blocks whose pool fits in ``bytes_budget`` bytes (may be 0)."""
    per_block = KVCachePool.bytes_for(1, num_layers, block_size, num_kv_heads, head_dim, dtype)
    return max(0, int(bytes_budget) // per_block)


class KVCachePool:
    """A zero-filled KV pool of ``num_blocks`` blocks for ``num_layers`` layers.

    The tensor is allocated (and zero-filled, so its pages are touched) once in the
    constructor and never reallocated; every accessor returns a view of it or a copy.
    ``tensor`` instead wraps an existing C-contiguous tensor of shape
    ``blocks_shape(num_blocks)`` and ``dtype`` on ``device`` (e.g. one backed by shared memory),
    used as is: not copied and not zeroed.
    """

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tensor: torch.Tensor | None = None,
    ) -> None:
        _check_positive(
            num_blocks=num_blocks,
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        if tensor is None:
            self.tensor = torch.zeros(self.blocks_shape(num_blocks), dtype=dtype, device=device)
        else:
            self._check_wrapped(tensor)
            self.device = tensor.device
            self.tensor = tensor
        self.bytes_per_block: int = self.bytes_for(
            1, num_layers, block_size, num_kv_heads, head_dim, dtype
        )

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def shape_for(
        num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int, int, int]:
        """Shape of the pool tensor of these dimensions (see the module docstring's layout)."""
        return (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)

    @staticmethod
    def bytes_for(
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """Bytes taken by a pool of these dimensions (``tensor.nbytes`` once allocated)."""
        shape = KVCachePool.shape_for(num_blocks, num_layers, block_size, num_kv_heads, head_dim)
        return math.prod(shape) * _element_size(dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def blocks_shape(self, n: int) -> tuple[int, int, int, int, int, int]:
        """Shape of ``n`` stacked blocks, as returned by ``export_blocks``."""
        return self.shape_for(n, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def num_slots(self) -> int:
        """Number of token slots: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Total bytes of the pool tensor."""
        return self.num_blocks * self.bytes_per_block

    # ------------------------------------------------------------------ views
    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views ``(k_cache, v_cache)`` of one layer, each
        ``(num_blocks, block_size, num_kv_heads, head_dim)``. Writes go to the pool."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.tensor[:, layer, 0], self.tensor[:, layer, 1]

    def block_view(self, block_id: int) -> torch.Tensor:
        """The contiguous region of one block (all layers, K and V), as a view of shape
        ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        self._check_block_id(block_id)
        return self.tensor[block_id]

    def as_bytes(self, block_id: int) -> memoryview:
        """Zero-copy, writable raw bytes of one block (``bytes_per_block`` long); CPU only.

        The memoryview aliases the pool: later writes to the block show through it.
        Use ``bytes(pool.as_bytes(b))`` for a snapshot.
        """
        if self.device.type != "cpu":
            raise ValueError(f"as_bytes needs a CPU pool, this one is on {self.device}")
        raw = self.block_view(block_id).view(torch.uint8).reshape(-1)
        return raw.numpy().data  # 1-D uint8 -> format "B", len == bytes_per_block

    # ------------------------------------------------------------- transfer
    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy of the given blocks, shape
        ``(len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim)``, in order."""
        index = self._index(block_ids)
        return self.tensor.index_select(0, index)

    def import_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Copy ``data`` (as produced by ``export_blocks``) into the given blocks, in order.

        Raises ValueError on a shape or dtype mismatch, an out-of-range id, or a
        repeated id. ``data`` may live on another device; it is copied to the pool's.
        """
        expected = self.blocks_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"import_blocks: data shape {tuple(data.shape)} != {expected}")
        if data.dtype != self.dtype:
            raise ValueError(f"import_blocks: data dtype {data.dtype} != pool dtype {self.dtype}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("import_blocks: block_ids contains duplicates")
        index = self._index(block_ids)
        self.tensor.index_copy_(0, index, data.to(self.device))

    # -------------------------------------------------------------- helpers
    def _check_wrapped(self, tensor: torch.Tensor) -> None:
        expected = self.blocks_shape(self.num_blocks)
        if tuple(tensor.shape) != expected or tensor.dtype != self.dtype:
            raise ValueError(
                f"tensor {tuple(tensor.shape)} {tensor.dtype} is not a pool of {expected} {self.dtype}"
            )
        if not tensor.is_contiguous():
            raise ValueError("a pool tensor must be C-contiguous")
        if tensor.device.type != self.device.type or (
            self.device.index is not None and tensor.device != self.device
        ):
            raise ValueError(f"tensor is on {tensor.device}, the pool on {self.device}")

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= int(block_id) < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(b) for b in block_ids]
        for b in ids:
            self._check_block_id(b)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def __repr__(self) -> str:
        return (
            f"KVCachePool(num_blocks={self.num_blocks}, num_layers={self.num_layers}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )
