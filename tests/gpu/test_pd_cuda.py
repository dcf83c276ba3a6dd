"""Prefill in one process, decode in another, with the engines on a CUDA GPU (skipped without
CUDA): the pages leave a GPU pool and land in one, over each transport that moves them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHUNK_BLOCKS = 8
PARAMS = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
PROMPTS = [
    [(7 * i + j) % 500 + 1 for i in range(n)] for j, n in enumerate((1, 17, 16 * 40 + 3, 200))
]


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint(arch="llama", seed=13))


@pytest.fixture(scope="module")
def expected(model: str) -> list[list[int]]:
    """The colocated engine on the GPU, prefilling in the same chunks as the prefill process."""
    from tandem import LLM, SamplingParams

    llm = LLM(model=model, device="cuda", num_kv_blocks=256,
              max_num_batched_tokens=16 * CHUNK_BLOCKS)  # fmt: skip
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**PARAMS))]


@pytest.mark.parametrize(
    ("transport", "devices"),
    [("shm", ("cuda", "cuda")), ("torch", ("cuda", "cuda")), ("shm", ("cuda", "cpu"))],
)
def test_pd_transfer_between_gpu_pools_is_exact(
    transport: str, devices: tuple[str, str], model: str, expected: list[list[int]]
) -> None:
    """Greedy tokens equal the colocated GPU engine's (checksums on: pages arrive byte-exact);
    afterwards neither side holds or pins a block. The torch transport picks gloo here (both
    pools on one GPU, which NCCL refuses)."""
    from tandem.kv_transfer.process_pair import PDProcesses

    pd = PDProcesses(model, transport, chunk_blocks=CHUNK_BLOCKS, devices=devices)
    try:
        for i, prompt in enumerate(PROMPTS):
            got = pd.run(f"r{i}", prompt, PARAMS)
            assert got == expected[i], f"prompt {i} over {transport} {devices}"
        assert sum(e["kind"] == "committed" for e in pd.events) == len(PROMPTS)
        pd.wait_settled(10)  # (the last acknowledgements may still be on their way)
    finally:
        pd.close()
