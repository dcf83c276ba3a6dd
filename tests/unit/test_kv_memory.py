"""Sizing the KV pool: `gpu_memory_utilization` on a GPU (with a fake device's memory),
`kv_cache_memory_gb` / `num_kv_blocks` anywhere, and the profiling step the GPU sizing runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM
from tandem.deploy.cluster_config import ClusterConfig
from tandem.engine import llm_engine
from tandem.engine.config import EngineConfig
from tandem.engine.kv_memory import (
    GIB,
    DeviceMemory,
    InsufficientMemoryError,
    MemoryBaseline,
    kv_pool_bytes,
    peak_forward_bytes,
)
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model import CausalLM
from tandem.engine.model_config import load_model_spec
from tandem.kernels.kv_cache import KVCachePool

MIB = 1 << 20


class FakeMemory(DeviceMemory):
    """A device of `total` bytes; the test moves `free`, `allocated`, `reserved`, `peak`."""

    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free
        self.allocated_now = self.reserved_now = self.peak = 0
        self.settled = 0

    def free_and_total(self) -> tuple[int, int]:
        return self.free, self.total

    def allocated(self) -> int:
        return self.allocated_now

    def reserved(self) -> int:
        return self.reserved_now

    def reset_peak(self) -> None:
        self.peak = self.allocated_now

    def peak_allocated(self) -> int:
        return self.peak

    def settle(self) -> None:
        self.settled += 1


def test_the_pool_gets_the_share_that_weights_activations_and_workspaces_leave() -> None:
    memory = FakeMemory(total=80 * GIB, free=79 * GIB)  # 1 GiB: the CUDA context, others
    baseline = MemoryBaseline.take(memory)
    # The weights load (16 GiB), and cuBLAS takes 256 MiB outside torch's allocator.
    memory.allocated_now = memory.reserved_now = 16 * GIB
    memory.free = 79 * GIB - 16 * GIB - 256 * MIB
    left = kv_pool_bytes(baseline, memory, utilization=0.9, activation_peak=3 * GIB)
    assert left == int(0.9 * 80 * GIB) - 16 * GIB - 3 * GIB - 256 * MIB
    # A lower share leaves less to the pool, byte for byte.
    lower = kv_pool_bytes(baseline, memory, utilization=0.5, activation_peak=3 * GIB)
    assert left - lower == int(0.9 * 80 * GIB) - int(0.5 * 80 * GIB)


def test_asking_for_more_than_was_free_is_refused_with_the_figures() -> None:
    memory = FakeMemory(total=80 * GIB, free=40 * GIB)  # another engine holds half the GPU
    baseline = MemoryBaseline.take(memory)
    with pytest.raises(InsufficientMemoryError, match=r"72\.00 GiB .* only 40\.00 GiB were free"):
        kv_pool_bytes(baseline, memory, utilization=0.9, activation_peak=0)
    assert kv_pool_bytes(baseline, memory, utilization=0.45, activation_peak=0) == int(
        0.45 * 80 * GIB
    )


def test_a_share_the_model_already_fills_is_refused() -> None:
    memory = FakeMemory(total=24 * GIB, free=23 * GIB)
    baseline = MemoryBaseline.take(memory)
    memory.allocated_now = memory.reserved_now = 15 * GIB
    memory.free -= 15 * GIB
    with pytest.raises(InsufficientMemoryError, match="leaves no room for the KV cache"):
        kv_pool_bytes(baseline, memory, utilization=0.5, activation_peak=GIB)


def test_the_profiling_step_runs_the_model_over_max_num_batched_tokens(
    tiny_checkpoint: Any,
) -> None:
    """The step the GPU sizing profiles is a valid forward (here on the CPU), and the figure is
    the allocator's rise over what was allocated before it."""
    path = tiny_checkpoint()
    spec = load_model_spec(path)
    model = CausalLM(spec).eval()
    shapes: list[tuple[int, ...]] = []

    def recording(*args: Any) -> torch.Tensor:
        logits = model(*args)
        shapes.append(tuple(logits.shape))
        return logits

    memory = FakeMemory(total=GIB, free=GIB)
    memory.allocated_now = 5 * MIB
    peak = peak_forward_bytes(
        recording,
        spec,
        num_tokens=37,
        block_size=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
        memory=memory,
    )
    assert peak == 0 and memory.settled >= 2  # (a fake's peak does not move)
    assert shapes == [(37, spec.vocab_size)]  # every row's logits


def test_on_the_cpu_the_pool_is_kv_cache_memory_gb(tiny_checkpoint: Any) -> None:
    path = str(tiny_checkpoint())
    spec = load_model_spec(path)
    per_block = KVCachePool.bytes_for(1, spec.num_layers, 16, spec.num_kv_heads, spec.head_dim)
    sized = LLMEngine(EngineConfig(model=path, kv_cache_memory_gb=0.001, max_num_seqs=1000))
    assert sized.kv_pool.num_blocks == int(0.001 * GIB) // per_block
    # gpu_memory_utilization is a GPU's setting: the CPU pool stays 1 GiB (capped as ever).
    default = EngineConfig(model=path, max_model_len=64, max_num_seqs=3)
    assert default.kv_cache_memory_gb is None and default.gpu_memory_utilization == 0.9
    assert LLMEngine(default).kv_pool.num_blocks == 3 * 4  # 3 requests of 64 tokens


def test_vllms_kv_cache_memory_bytes_sizes_the_pool(tiny_checkpoint: Any) -> None:
    llm = LLM(
        model=str(tiny_checkpoint()), kv_cache_memory_bytes=2 * MIB, gpu_memory_utilization=0.5
    )
    assert llm.engine.config.kv_cache_memory_gb == 2 * MIB / GIB
    assert llm.engine.config.gpu_memory_utilization == 0.5


def test_a_role_on_a_share_of_a_gpu_takes_that_share_of_its_memory() -> None:
    config = ClusterConfig(
        prefill={"num_gpus": 0.5, "engine": {"device": "cuda"}},
        decode={"num_gpus": 0.25, "engine": {"device": "cuda", "gpu_memory_utilization": 0.6}},
        engine={"device": "cpu"},
    )
    model = "unused"
    assert config.engine_config("prefill", model).gpu_memory_utilization == 0.45
    assert config.engine_config("decode", model).gpu_memory_utilization == 0.6  # set: kept
    whole = ClusterConfig(prefill={"num_gpus": 1}, decode={"num_gpus": 0})
    assert whole.engine_config("prefill", model).gpu_memory_utilization == 0.9
    assert whole.engine_config("decode", model).gpu_memory_utilization == 0.9
    # `tandem serve --gpu-memory-utilization` sets every engine's, shares of a GPU included.
    from tandem.deploy.cluster_config_flags import cluster_config_from as _config

    flagged = _config(
        None, {"prefill": {"num_gpus": 0.5}}, {}, {("engine", "gpu_memory_utilization"): 0.7}
    )
    assert flagged.engine_config("prefill", model).gpu_memory_utilization == 0.7


def test_an_engine_sized_by_its_share_of_a_device(
    tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's whole sizing path (baseline, weights, the profiling step, the share) with a
    fake device of 64 MiB standing in for a GPU's memory."""
    path = str(tiny_checkpoint())
    spec = load_model_spec(path)
    memory = FakeMemory(total=64 * MIB, free=60 * MIB)
    monkeypatch.setattr(llm_engine, "sizing_memory", lambda config, device: memory)
    config = EngineConfig(model=path, gpu_memory_utilization=0.5, max_num_seqs=100_000)
    engine = LLMEngine(config)
    per_block = KVCachePool.bytes_for(1, spec.num_layers, 16, spec.num_kv_heads, spec.head_dim)
    assert engine.kv_pool.num_blocks == (32 * MIB) // per_block
    with pytest.raises(InsufficientMemoryError, match="only 0.06 GiB were free"):
        LLMEngine(config.model_copy(update={"gpu_memory_utilization": 0.99}))
