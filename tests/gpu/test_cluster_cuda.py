"""The PD cluster on Ray with both workers' engines on a CUDA GPU (skipped without CUDA): the
answers through the HTTP API equal the colocated GPU engine's, and a client that leaves
mid-stream leaves no block held on either worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHUNK_TOKENS = 128
MAX_TOKENS = 10
PROMPTS = [[(5 * i + j) % 500 + 3 for i in range(n)] for j, n in enumerate((3, 40, 300, 700))]


@pytest.fixture(scope="module")
def gpu_cluster(tiny_checkpoint: Any) -> Iterator[Any]:
    import ray
    from ray import serve

    from tests.integration.conftest import Cluster, free_port

    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, namespace="tandem-gpu-tests",
             log_to_driver=False)  # fmt: skip
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield Cluster(http_port, free_port(), tiny_checkpoint(arch="llama", seed=13))
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def expected(gpu_cluster: Any) -> list[list[int]]:
    from tandem import LLM, SamplingParams

    llm = LLM(model=str(gpu_cluster.model), device="cuda", num_kv_blocks=512,
              max_num_batched_tokens=CHUNK_TOKENS)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def _deploy(cluster: Any, transport: str) -> str:
    role = {"num_cpus": 0.25, "num_gpus": 0.5}  # both workers share the one GPU
    engine = {"device": "cuda", "num_kv_blocks": 512, "max_num_batched_tokens": CHUNK_TOKENS}
    return str(
        cluster.deploy(
            transport=transport,
            engine=engine,
            prefill=role,
            decode=dict(role),
            # every request takes the PD path (no local prefill on decode)
            decode_routing={"conditional_prefill_max_tokens": 0},
        )
    )


def _wait_idle(cluster: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        workers = cluster.workers()
        if all(
            w["num_free_blocks"] == w["num_blocks"]
            and w["num_requests"] == 0
            and w.get("num_reservations", 0) == 0
            and w.get("num_transfers", 0) == 0
            for w in workers
        ):
            return workers
        assert time.monotonic() < deadline, f"workers hold blocks: {workers}"
        time.sleep(0.1)


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_cluster_on_gpu_equals_the_colocated_engine(
    transport: str, gpu_cluster: Any, expected: list[list[int]]
) -> None:
    base = _deploy(gpu_cluster, transport)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        resp = requests.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True},
            timeout=60,
        )  # fmt: skip
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == want, f"{len(prompt)}-token prompt over {transport}"
    workers = _wait_idle(gpu_cluster)
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]

    # A client that leaves after the first streamed token: decode cancels, nothing is held.
    with requests.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": PROMPTS[-1], "max_tokens": 500, "temperature": 0,
              "ignore_eos": True, "stream": True},
        stream=True,
        timeout=60,
    ) as resp:  # fmt: skip
        assert resp.status_code == 200
        lines = (line for line in resp.iter_lines() if line.startswith(b"data: {"))
        assert json.loads(next(lines)[6:])["choices"][0]["text"] is not None
    _wait_idle(gpu_cluster)
