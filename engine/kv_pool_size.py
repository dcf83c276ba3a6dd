"""How many blocks an engine's KV pool has, and the longest sequence they allow.

The pool is `num_kv_blocks` blocks when set; else as many as `kv_cache_memory_gb` holds; else,
on a GPU, what `gpu_memory_utilization` leaves once weights and the largest step are counted
(`kv_memory`, measured around the weights' loading: `sizing_memory` before it,
`kv_bytes_by_utilization` after); else, on the CPU, 1 GiB. Either way no more than
`max_num_seqs` requests of the longest length could use.
"""

from __future__ import annotations

import logging
import math

import torch

from tandem.engine.config import DEFAULT_KV_CACHE_GB, EngineConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.kv_memory import (
    GIB,
    CudaMemory,
    DeviceMemory,
    MemoryBaseline,
    kv_pool_bytes,
    peak_forward_bytes,
)
from tandem.engine.model_config import CONTEXT_SOURCE, ModelSpec
from tandem.engine.model_runner import Model
from tandem.kernels.kv_cache import KVCachePool

logger = logging.getLogger(__name__)


def sizing_memory(config: EngineConfig, device: torch.device) -> DeviceMemory | None:
    """The device memory the pool is sized by (`gpu_memory_utilization`): a GPU's, unless
    `num_kv_blocks` or `kv_cache_memory_gb` sizes it."""
    if config.num_kv_blocks is not None or config.kv_cache_memory_gb is not None:
        return None
    return CudaMemory(device) if device.type == "cuda" else None


def kv_bytes_by_utilization(
    config: EngineConfig,
    spec: ModelSpec,
    model: Model,
    device: torch.device,
    memory: DeviceMemory,
    baseline: MemoryBaseline,
) -> int:
    """The pool's share of `gpu_memory_utilization`, after one profiling step of
    `max_num_batched_tokens` prompt tokens (the weights loaded since `baseline`)."""
    max_len = config.max_model_len or spec.context_length
    peak = peak_forward_bytes(
        model,
        spec,
        num_tokens=min(config.max_num_batched_tokens, max_len),
        block_size=config.block_size,
        dtype=config.torch_dtype,
        device=device,
        memory=memory,
    )
    kv_bytes = kv_pool_bytes(
        baseline, memory, utilization=config.gpu_memory_utilization, activation_peak=peak
    )
    logger.info(
        "gpu_memory_utilization=%g of %.2f GiB: weights %.2f GiB, largest step %.2f GiB, "
        "KV cache %.2f GiB",
        config.gpu_memory_utilization,
        baseline.total / GIB,
        (memory.allocated() - baseline.allocated) / GIB,
        peak / GIB,
        kv_bytes / GIB,
    )
    return kv_bytes


def pool_blocks(config: EngineConfig, spec: ModelSpec, kv_bytes: int | None) -> tuple[int, int]:
    """(blocks, max model length): `num_kv_blocks`, or as many blocks as `kv_bytes` hold
    (None: `kv_cache_memory_gb`, or 1 GiB), capped at what `max_num_seqs` requests of the
    longest length could use; InvalidRequestError for a `max_model_len` the model or the
    pool cannot take."""
    context = spec.context_length
    if config.max_model_len is not None and config.max_model_len > context:
        raise InvalidRequestError(
            f"max_model_len={config.max_model_len} exceeds the model's context of {context} "
            f"tokens ({CONTEXT_SOURCE})"
        )
    target_len = config.max_model_len or spec.context_length  # (vLLM's derived length)
    blocks_per_seq = math.ceil(target_len / config.block_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        if kv_bytes is None:
            kv_bytes = int((config.kv_cache_memory_gb or DEFAULT_KV_CACHE_GB) * GIB)
        per_block = KVCachePool.bytes_for(
            1,
            spec.num_layers,
            config.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            config.torch_dtype,
        )
        num_blocks = max(1, min(kv_bytes // per_block, blocks_per_seq * config.max_num_seqs))
    capacity = num_blocks * config.block_size
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise InvalidRequestError(
            f"max_model_len={config.max_model_len} does not fit in the KV pool "
            f"({num_blocks} blocks x {config.block_size} = {capacity} tokens); "
            "raise num_kv_blocks / kv_cache_memory_gb / gpu_memory_utilization or lower "
            "max_model_len"
        )
    if capacity < 2:  # (a prompt token and a generated one)
        raise InvalidRequestError(
            f"the KV pool holds {capacity} token ({num_blocks} block x {config.block_size}): "
            "no request fits; raise num_kv_blocks / kv_cache_memory_gb / block_size"
        )
    if capacity < target_len:  # (vLLM refuses to start here; a small pool is fine for tests)
        logger.warning(
            "max_model_len lowered from %d to %d tokens: the KV pool holds only %d blocks x %d; "
            "a longer prompt is refused and outputs stop there (finish_reason 'length'); raise "
            "num_kv_blocks / kv_cache_memory_gb / gpu_memory_utilization, or set max_model_len",
            target_len,
            capacity,
            num_blocks,
            config.block_size,
        )
    return num_blocks, min(target_len, capacity)
