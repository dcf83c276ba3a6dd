"""Prefill in one process, decode in another, over every transport that runs on CPU."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.kv_transfer.process_pair import PDProcesses

TRANSPORTS = ["shm", "torch", "ucx", "ucx-push"]
OPTIONS = {"ucx-push": {"pull": False}}
"""ucx on one machine has the receiver read the pages (pull); `ucx-push` has UCX move them, as
between machines."""


def _available(name: str) -> bool:
    module = {
        "shm": "tandem.kv_transfer.shm",
        "torch": "tandem.kv_transfer.torch_dist",
        "ucx": "ucxx",
    }[name.partition("-")[0]]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint(arch="llama", seed=13))


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_process_transfer_is_exact(transport: str, model: str) -> None:
    if not _available(transport):
        pytest.skip(f"transport {transport!r} is not installed here")
    prompts = [
        [(7 * i + j) % 500 + 1 for i in range(n)] for j, n in enumerate((1, 17, 16 * 40 + 3, 200))
    ]
    params = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
    expected = [
        o.token_ids
        for o in LLM(model=model, num_kv_blocks=256).generate(prompts, SamplingParams(**params))
    ]
    pd = PDProcesses(model, transport.partition("-")[0], OPTIONS.get(transport))
    try:
        for i, prompt in enumerate(prompts):
            assert pd.run(f"r{i}", prompt, params) == expected[i], f"prompt {i} over {transport}"
        chunks = [e for e in pd.events if e["kind"] == "committed"]
        assert len(chunks) == len(prompts)
        free, total = pd.check_decode()
        assert free == total
    finally:
        pd.close()


# KV layouts other than the tiny llama's: head_dim not hidden / heads (qwen3, with q/k norms),
# one KV head (qwen2, with q/k/v biases), and a sliding window shorter than the prompts and the
# decode that follows the transfer (mistral).
ARCHITECTURES = {
    "qwen3": dict(arch="qwen3", seed=3, head_dim=32),
    "qwen2": dict(arch="qwen2", seed=2, kv_heads=1),
    "mistral": dict(arch="mistral", seed=4, tie_embeddings=True, sliding_window=48),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_two_process_transfer_is_exact_for_other_architectures(
    arch: str, tiny_checkpoint: Any
) -> None:
    path = str(tiny_checkpoint(**ARCHITECTURES[arch]))
    prompts = [[(11 * i + j) % 500 + 1 for i in range(n)] for j, n in enumerate((5, 16 * 12 + 7))]
    params = {"temperature": 0.0, "max_tokens": 60, "ignore_eos": True}
    expected = [
        o.token_ids
        for o in LLM(model=path, num_kv_blocks=256).generate(prompts, SamplingParams(**params))
    ]
    pd = PDProcesses(path, "shm")
    try:
        for i, prompt in enumerate(prompts):
            assert pd.run(f"r{i}", prompt, params) == expected[i], f"prompt {i} of {arch}"
        assert pd.check_decode() == (256, 256)
    finally:
        pd.close()
