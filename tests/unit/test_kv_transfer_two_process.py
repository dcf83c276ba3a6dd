"""Prefill in one process, decode in another, over every transport that runs on CPU."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.kv_transfer.process_pair import PDProcesses

TRANSPORTS = ["shm", "torch", "ucx"]


def _available(name: str) -> bool:
    module = {
        "shm": "tandem.kv_transfer.shm",
        "torch": "tandem.kv_transfer.torch_dist",
        "ucx": "ucxx",
    }[name]
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
    pd = PDProcesses(model, transport)
    try:
        for i, prompt in enumerate(prompts):
            assert pd.run(f"r{i}", prompt, params) == expected[i], f"prompt {i} over {transport}"
        chunks = [e for e in pd.events if e["kind"] == "committed"]
        assert len(chunks) == len(prompts)
        free, total = pd.check_decode()
        assert free == total
    finally:
        pd.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sender_killed_mid_stream(transport: str, model: str) -> None:
    if not _available(transport):
        pytest.skip(f"transport {transport!r} is not installed here")
    pd = PDProcesses(model, transport, chunk_blocks=2, lease_s=30.0)
    try:
        prompt = [(3 * i) % 500 + 1 for i in range(16 * 120)]  # 120 blocks: 60 chunks
        pd.start("k", prompt, {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True})
        assert pd.wait_streaming("k"), "the reservation ended before its first chunk came"
        pd.prefill.kill()  # mid-stream: pages have come, more are due
        killed = time.monotonic()
        failed = pd.wait_event(pd.decode_conn, "failed", "k", timeout=30)
        assert failed["error"]
        # Found by the stall timeout (3 s here) or the lost link, well before the 30 s lease.
        assert time.monotonic() - killed < 15, failed
        assert "lease" not in failed["error"], failed
        # Blocks a dead sender might still have been writing are held for the stall timeout.
        deadline = time.monotonic() + 10
        while (free_total := pd.check_decode())[0] != free_total[1]:
            assert time.monotonic() < deadline, f"decode holds blocks: {free_total}"
            time.sleep(0.1)
    finally:
        pd.close()
