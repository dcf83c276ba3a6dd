"""Choosing a paged-attention implementation by name.

Every backend has the ``PagedAttentionFn`` signature and the contract documented in
``tandem.kernels.paged_attention``. Built in: ``"reference"`` (slow, float32, validating)
and ``"cpu"`` (batched decode + per-chunk prefill on SDPA). A GPU backend (e.g. a Triton
kernel) registers itself with ``register_attention_backend("triton", fn)`` from its own
module, so importing this package never needs Triton or CUDA.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.kernels.paged_attention import paged_attention_cpu, paged_attention_reference

__all__ = [
    "ATTENTION_BACKENDS",
    "PagedAttentionFn",
    "get_attention_backend",
    "register_attention_backend",
]


class PagedAttentionFn(Protocol):
    """Signature shared by all paged-attention backends."""

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
    ) -> torch.Tensor: ...


ATTENTION_BACKENDS: dict[str, PagedAttentionFn] = {
    "reference": paged_attention_reference,
    "cpu": paged_attention_cpu,
}


def register_attention_backend(name: str, fn: PagedAttentionFn, *, overwrite: bool = False) -> None:
    """Add a backend under ``name``; ValueError if taken unless ``overwrite``."""
    if name in ATTENTION_BACKENDS and not overwrite:
        raise ValueError(f"attention backend {name!r} is already registered")
    ATTENTION_BACKENDS[name] = fn


def get_attention_backend(name: str = "cpu") -> PagedAttentionFn:
    """The backend called ``name``; ValueError listing the known names otherwise."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r} (known: {known})") from None
