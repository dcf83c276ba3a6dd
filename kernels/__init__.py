"""Attention and KV-cache kernels: the paged KV pool, the KV write, paged attention.

Torch-only on import (no CUDA/Triton needed): the Triton kernels (``triton_attention``,
``triton_kv_write``) load on first use, chosen by ``dispatch`` for CUDA tensors. See ``paged_attention`` for the attention
contract and ``kv_cache`` for the pool layout. Note: the package attribute
``tandem.kernels.paged_attention`` is the *function*; the module of the same name is
reachable with ``from tandem.kernels.paged_attention import ...`` or ``importlib``.
"""

from tandem.kernels.backends import (
    KERNEL_BACKENDS,
    KernelBackend,
    PagedAttentionFn,
    WriteKVFn,
    get_attention_backend,
    get_kernel_backend,
    register_kernel_backend,
)
from tandem.kernels.kv_cache import KVCachePool, num_blocks_for_memory
from tandem.kernels.kv_write import write_kv
from tandem.kernels.paged_attention import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_reference,
)

__all__ = [
    "KERNEL_BACKENDS",
    "KVCachePool",
    "KernelBackend",
    "PagedAttentionFn",
    "WriteKVFn",
    "get_attention_backend",
    "get_kernel_backend",
    "num_blocks_for_memory",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_reference",
    "register_kernel_backend",
    "write_kv",
]
