"""Kernel backends by name: a paged-attention function and a KV-write function.

Every attention function has the ``PagedAttentionFn`` signature and the contract documented in
``tandem.kernels.paged_attention``; every KV write the ``WriteKVFn`` one (``write_kv``).

Built in:
* ``"auto"`` (the default): per call, Triton for CUDA tensors, torch for CPU ones
  (``tandem.kernels.dispatch`` is the one place that decides);
* ``"cpu"``: the torch path (batched decode + per-chunk prefill on SDPA), on any device;
* ``"reference"``: slow, float32, validating attention; torch KV write;
* ``"triton"``: always the Triton kernels, loaded on first use (needs ``triton``; on CPU
  tensors only under the Triton interpreter, ``TRITON_INTERPRET=1``, for tests).

``tandem.kernels`` has no ``__init__.py`` on purpose (a namespace package): import from its
modules (``tandem.kernels.kv_cache``, ``.paged_attention``, ``.kv_write``, this one). A regular
package named ``kernels`` at the repository root would shadow Hugging Face's ``kernels``
distribution, which transformers imports, whenever the root is on ``sys.path`` (``python -m``,
pytest, Ray workers started from the checkout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.kernels.dispatch import paged_attention_auto, triton_kernels, write_kv_auto
from tandem.kernels.kv_write import write_kv
from tandem.kernels.paged_attention import paged_attention_cpu, paged_attention_reference

__all__ = [
    "KERNEL_BACKENDS",
    "KernelBackend",
    "PagedAttentionFn",
    "WriteKVFn",
    "get_attention_backend",
    "get_kernel_backend",
    "register_kernel_backend",
]


class PagedAttentionFn(Protocol):
    """Signature shared by all paged-attention functions. ``max_query_len`` and
    ``max_context_len`` are optional host-side hints; a backend may ignore them."""

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        max_query_len: int | None = None,
        max_context_len: int | None = None,
    ) -> torch.Tensor: ...


class WriteKVFn(Protocol):
    """Signature shared by all KV-cache writes (contract: ``tandem.kernels.write_kv``)."""

    def __call__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


@dataclass(frozen=True)
class KernelBackend:
    """The two kernels the model's attention layers call."""

    attention: PagedAttentionFn
    write_kv: WriteKVFn


KERNEL_BACKENDS: dict[str, KernelBackend] = {
    "auto": KernelBackend(paged_attention_auto, write_kv_auto),
    "cpu": KernelBackend(paged_attention_cpu, write_kv),
    "reference": KernelBackend(paged_attention_reference, write_kv),
}
_LAZY = ("triton",)


def register_kernel_backend(name: str, backend: KernelBackend, *, overwrite: bool = False) -> None:
    """Add a backend under ``name``; ValueError if taken unless ``overwrite``."""
    if (name in KERNEL_BACKENDS or name in _LAZY) and not overwrite:
        raise ValueError(f"kernel backend {name!r} is already registered")
    KERNEL_BACKENDS[name] = backend


def get_kernel_backend(name: str = "auto") -> KernelBackend:
    """The backend called ``name``; ValueError listing the known names otherwise,
    ImportError naming the extra to install for ``"triton"`` without the package."""
    if name in KERNEL_BACKENDS:
        return KERNEL_BACKENDS[name]
    if name == "triton":
        attention, write = triton_kernels()
        return KERNEL_BACKENDS.setdefault(name, KernelBackend(attention, write))
    known = ", ".join(sorted({*KERNEL_BACKENDS, *_LAZY}))
    raise ValueError(f"unknown kernel backend {name!r} (known: {known})")


def get_attention_backend(name: str = "auto") -> PagedAttentionFn:
    """Shortcut: the attention function of ``get_kernel_backend(name)``."""
    return get_kernel_backend(name).attention
