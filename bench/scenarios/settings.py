"""Every setting of the scenarios, in one place (docs/benchmarks.md quotes them).

Sized for a 2-core CPU machine: a 4-layer Llama (hidden 512, vocab 32k, ~30M parameters),
one torch thread per worker, and two workers in every configuration, so that colocated and
disaggregated runs get the same CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.bench.common import ModelShape
from tandem.bench.serving.datasets import MixedSpec

MODEL = ModelShape(layers=4)
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 16,
    "num_kv_blocks": 2048,
    "max_num_batched_tokens": 256,  # the chunked-prefill budget per step
    "max_num_seqs": 64,
}
WORKER: dict[str, Any] = {"num_cpus": 0.5, "torch_threads": 1}


def colocated(chunked: bool) -> dict[str, Any]:
    """Two workers that each prefill and decode their own requests."""
    return {
        "mode": "colocated",
        "engine": {**ENGINE, "enable_chunked_prefill": chunked},
        "decode": {**WORKER, "replicas": 2},
    }


def disaggregated() -> dict[str, Any]:
    """One prefill worker and one decode worker (chunked prefill on the prefill worker)."""
    return {
        "mode": "pd",
        "engine": dict(ENGINE),
        "prefill": {**WORKER, "replicas": 1},
        "decode": {**WORKER, "replicas": 1},
    }


CONFIGS: dict[str, dict[str, Any]] = {
    "colocated, no chunked prefill": colocated(chunked=False),
    "colocated, chunked prefill": colocated(chunked=True),
    "1 prefill + 1 decode": disaggregated(),
}


@dataclass(frozen=True)
class MixedScenario:
    """Mixed traffic (the seed's section 11 example, scaled): Poisson arrivals."""

    spec: MixedSpec = field(default_factory=MixedSpec)
    num_prompts: int = 60
    request_rate: float = 2.0
    no_load_prompts: int = 12  # short requests one at a time: the no-load TTFT
    seed: int = 0
    configs: tuple[str, ...] = tuple(CONFIGS)


@dataclass(frozen=True)
class GoodputScenario:
    """DistServe-style sweep: SLO attainment and goodput at each request rate."""

    input_len: int = 384
    output_len: int = 48
    range_ratio: float = 0.25
    rates: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
    seconds_per_rate: float = 12.0  # requests per rate = rate x this (at least 12)
    slos_ms: dict[str, float] = field(default_factory=lambda: {"ttft": 1500.0, "tpot": 30.0})
    attainment_target: float = 0.9
    seed: int = 0
    configs: tuple[str, ...] = ("colocated, chunked prefill", "1 prefill + 1 decode")


QUICK_MIXED = MixedScenario(num_prompts=16, no_load_prompts=4, spec=MixedSpec(scale=0.5))
QUICK_GOODPUT = GoodputScenario(rates=(2.0, 4.0), seconds_per_rate=4.0)
