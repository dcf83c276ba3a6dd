"""How big the KV pool of an engine on a GPU is: `gpu_memory_utilization`, as vLLM means it.

The engine may use `gpu_memory_utilization` of the GPU's total memory for everything it
allocates: weights, the activations of its largest step, and the KV pool. The pool gets what is
left once the other two are known:

1. `MemoryBaseline` is taken before the weights load (the CUDA context already exists);
2. the weights load; `peak_forward_bytes` runs one step of `max_num_batched_tokens` prompt
   tokens (every row's logits, as prompt logprobs may ask) on a throw-away pool and reads the
   allocator's peak;
3. `kv_pool_bytes` = utilization x total - weights - that peak - memory the GPU lost outside
   torch's allocator meanwhile (cuBLAS and Triton workspaces).

The CUDA context and other processes' memory are not this engine's: they fit in the rest
(1 - utilization). An engine that asks for more than was free when it started is refused with
the figures, as vLLM does: two engines on one GPU each take a share (`num_gpus: 0.5` in a
cluster config gives each 0.45 unless set).

On the CPU none of this applies: the pool is `kv_cache_memory_gb` (1 GiB unless set).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tandem.engine.errors import TandemError
from tandem.engine.model import AttentionMetadata
from tandem.engine.model_config import ModelSpec
from tandem.engine.model_runner import Model
from tandem.kernels.kv_cache import KVCachePool

GIB = 1 << 30


class InsufficientMemoryError(TandemError, ValueError):
    """The device has no room for the KV pool that the settings ask for."""


class DeviceMemory(ABC):
    """What the sizing reads of a device's memory (a fake in tests)."""

    @abstractmethod
    def free_and_total(self) -> tuple[int, int]:
        """Bytes free on the device (all processes counted) and its total."""

    @abstractmethod
    def allocated(self) -> int:
        """Bytes this process's tensors hold now."""

    @abstractmethod
    def reserved(self) -> int:
        """Bytes this process's allocator holds (tensors and its cache)."""

    @abstractmethod
    def reset_peak(self) -> None: ...

    @abstractmethod
    def peak_allocated(self) -> int:
        """The most `allocated()` was since `reset_peak`."""

    @abstractmethod
    def settle(self) -> None:
        """Waits for queued work and returns cached blocks (before a reading)."""


class CudaMemory(DeviceMemory):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free_and_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class MemoryBaseline:
    """The device before the engine loads anything."""

    free: int
    total: int
    allocated: int
    reserved: int

    @classmethod
    def take(cls, memory: DeviceMemory) -> MemoryBaseline:
        memory.settle()
        free, total = memory.free_and_total()
        return cls(free, total, memory.allocated(), memory.reserved())


def peak_forward_bytes(
    model: Model,
    spec: ModelSpec,
    *,
    num_tokens: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory: DeviceMemory,
) -> int:
    """Runs one prefill of `num_tokens` (one sequence, every row's logits) on a throw-away pool;
    returns how far the allocator rose above what was allocated before it."""
    num_blocks = math.ceil(num_tokens / block_size)
    pool = KVCachePool(
        num_blocks, spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim, dtype,
        device=device,
    )  # fmt: skip

    def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    rows = ints(list(range(num_tokens)))
    meta = AttentionMetadata(
        slot_mapping=rows,
        block_tables=ints([list(range(num_blocks))]),
        context_lens=ints([num_tokens]),
        query_start_loc=ints([0, num_tokens]),
        max_query_len=num_tokens,
        max_context_len=num_tokens,
    )
    input_ids = ints([0] * num_tokens)
    memory.settle()
    before = memory.allocated()
    memory.reset_peak()
    logits = model(input_ids, rows, meta, pool, rows)
    memory.settle()
    peak = memory.peak_allocated() - before
    del logits, pool
    memory.settle()
    return max(0, peak)


def kv_pool_bytes(
    baseline: MemoryBaseline,
    memory: DeviceMemory,
    *,
    utilization: float,
    activation_peak: int,
) -> int:
    """Bytes the KV pool may take (call after the weights loaded and the profile step ran)."""
    requested = int(utilization * baseline.total)
    if requested > baseline.free:
        raise InsufficientMemoryError(
            f"gpu_memory_utilization={utilization:g} asks for {requested / GIB:.2f} GiB of the "
            f"GPU's {baseline.total / GIB:.2f} GiB, but only {baseline.free / GIB:.2f} GiB were "
            "free when this engine started (another process, or another engine on this GPU, "
            "holds the rest): lower gpu_memory_utilization, or size the pool with "
            "kv_cache_memory_gb / num_kv_blocks"
        )
    memory.settle()
    free_now, _ = memory.free_and_total()
    weights = memory.allocated() - baseline.allocated
    torch_growth = memory.reserved() - baseline.reserved
    outside_torch = max(0, (baseline.free - free_now) - torch_growth)
    used = weights + activation_peak + outside_torch
    left = requested - used
    if left <= 0:
        raise InsufficientMemoryError(
            f"gpu_memory_utilization={utilization:g} ({requested / GIB:.2f} GiB) leaves no room "
            f"for the KV cache: weights take {weights / GIB:.2f} GiB, the largest step's "
            f"activations {activation_peak / GIB:.2f} GiB and other GPU memory "
            f"{outside_torch / GIB:.2f} GiB; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens"
        )
    return left
