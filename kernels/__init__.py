"""Attention and KV-cache kernels: the paged KV pool, the KV write, paged attention.

Torch-only on import (no CUDA/Triton needed). See ``paged_attention`` for the attention
contract and ``kv_cache`` for the pool layout. Note: the package attribute
``tandem.kernels.paged_attention`` is the *function*; the module of the same name is
reachable with ``from tandem.kernels.paged_attention import ...`` or ``importlib``.
"""

from tandem.kernels.backends import (
    ATTENTION_BACKENDS,
    PagedAttentionFn,
    get_attention_backend,
    register_attention_backend,
)
from tandem.kernels.kv_cache import KVCachePool, num_blocks_for_memory
from tandem.kernels.kv_write import write_kv
from tandem.kernels.paged_attention import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_reference,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "KVCachePool",
    "PagedAttentionFn",
    "get_attention_backend",
    "num_blocks_for_memory",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_reference",
    "register_attention_backend",
    "write_kv",
]
