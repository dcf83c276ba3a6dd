"""The one place that decides which kernel runs: Triton for CUDA tensors, torch for CPU ones.

``paged_attention_auto`` and ``write_kv_auto`` look at the device of the tensors they get:
on CUDA they run the Triton kernels (``triton_attention``, ``triton_kv_write``) when the
optional ``triton`` package is installed (extra ``tandem-serve[gpu]``), otherwise the torch
path with a warning logged once; on the CPU always the torch path. ``triton`` is imported
only when a CUDA tensor first arrives (or a caller asks for the Triton functions explicitly),
so importing tandem never needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

import torch

from tandem.kernels.kv_write import write_kv
from tandem.kernels.paged_attention import paged_attention_cpu

__all__ = [
    "paged_attention_auto",
    "triton_available",
    "triton_kernels",
    "write_kv_auto",
]

logger = logging.getLogger(__name__)


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def triton_kernels() -> tuple[Any, Any]:
    """``(paged_attention_triton, write_kv_triton)``; ImportError naming the extra if missing."""
    if not triton_available():
        raise ImportError(
            "the Triton kernels need the 'triton' package: pip install 'tandem-serve[gpu]'"
        )
    from tandem.kernels.triton_attention import paged_attention_triton
    from tandem.kernels.triton_kv_write import write_kv_triton

    return paged_attention_triton, write_kv_triton


@functools.cache
def _use_triton_on_cuda() -> bool:
    if triton_available():
        return True
    logger.warning("CUDA tensors but no 'triton' package: using the torch kernels (slower)")
    return False


def paged_attention_auto(
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
) -> torch.Tensor:
    """Paged attention on the tensors' device (contract: ``tandem.kernels.paged_attention``)."""
    attention = triton_kernels()[0] if query.is_cuda and _use_triton_on_cuda() else None
    out: torch.Tensor = (attention or paged_attention_cpu)(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        scale,
        sliding_window=sliding_window,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
    )
    return out


def write_kv_auto(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The KV-cache write on the tensors' device (contract: ``tandem.kernels.write_kv``)."""
    write = triton_kernels()[1] if key.is_cuda and _use_triton_on_cuda() else write_kv
    write(k_cache, v_cache, key, value, slot_mapping)
