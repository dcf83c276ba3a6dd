"""Page-aligned anonymous memory with transparent huge pages, for KV pools that transports move.

UCX's shared-memory copies (CMA) pin the peer's pages one page at a time: with 4 KiB pages they
reach about half of what they reach over 2 MiB pages, so pools that UCX reads or writes are
allocated here. Where the kernel offers THP only on request (``madvise`` mode) this asks for it;
where it offers none the memory is ordinary anonymous memory and everything still works.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

from tandem.kernels.kv_cache import KVCachePool

HUGE_PAGE = 2 << 20


def hugepage_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled, already faulted-in uint8 tensor of `nbytes`, 2 MiB aligned, advised to use
    transparent huge pages. The mapping lives as long as the tensor (and its views)."""
    if nbytes <= 0:
        return torch.zeros(0, dtype=torch.uint8)
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)  # (shared maps get no THP)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)  # zero-filled
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive
    skip = -whole.data_ptr() % HUGE_PAGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None:
        with contextlib.suppress(OSError):  # kernels without THP: plain pages
            mm.madvise(advise, (skip // mmap.PAGESIZE) * mmap.PAGESIZE, nbytes)
    out = whole[skip : skip + nbytes]
    out.zero_()  # fault every page in now (huge pages fault 512x fewer times)
    return out


def allocate_hugepage_pool(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> KVCachePool:
    """A zero-filled CPU `KVCachePool` over `hugepage_buffer` memory."""
    nbytes = KVCachePool.bytes_for(
        num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype
    )
    shape = KVCachePool.shape_for(num_blocks, num_layers, block_size, num_kv_heads, head_dim)
    tensor = hugepage_buffer(nbytes).view(dtype).view(shape)
    return KVCachePool(
        num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype, tensor=tensor
    )
