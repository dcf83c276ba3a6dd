"""A decode worker that dies in the middle of a stream: the stream goes on, exactly, from the
tokens already sent, on the decode worker still alive (greedy, and seeded sampling with a
presence penalty: the new worker counts the tokens sent as the request's output).

A prefill worker that dies: the requests sent right after all succeed, exactly, on the one
still alive. Before, those routed to the dead one failed for up to 10 s (its registry entry
lingers): with a 503 while the router's connection to it was breaking, then with a 500
(`ConnectionRefusedError`) each time the router reconnected. A request routed there just
before the router noticed starts over on the live workers; that race is rare here, so
`tests/unit/test_worker_lost.py` covers the starting over itself."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
import ray
import requests

from tandem import LLM, SamplingParams
from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _kill_replica(worker_id: str) -> None:
    """Kills the Serve replica behind `worker_id` ("prefill/<replica id>") for good."""
    replica = worker_id.split("/", 1)[1]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if replica in a["name"]]  # fmt: skip
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def _wait_for_all_answering(cluster: Cluster, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any("error" in w for w in cluster.workers()) and time.monotonic() < deadline:
        time.sleep(0.2)


def test_requests_after_a_prefill_worker_dies_all_succeed_exactly(
    cluster: Cluster, reference: LLM
) -> None:
    base_url = cluster.deploy(prefill={"replicas": 2, "num_cpus": 0.25},
                              decode={"replicas": 1, "num_cpus": 0.25})  # fmt: skip
    prompts = [f"request number {i} about the weather" for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = reference.generate(prompts, params, use_tqdm=False)
    prefill = sorted(w["worker_id"] for w in cluster.workers() if w["role"] == "prefill")
    assert len(prefill) == 2
    _kill_replica(prefill[0])
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    outcomes: list[Any] = []
    for prompt, ref in zip(prompts, expected, strict=True):
        try:
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                            temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
            outcomes.append(out.choices[0].text == ref.text)
        except openai.APIStatusError as exc:
            outcomes.append(f"{exc.status_code} {exc.body}")
    cluster.config = {}  # the next test deploys afresh (Serve is replacing the replica)
    assert outcomes == [True] * len(prompts)
    live = [w for w in cluster.workers() if w["role"] == "prefill" and "error" not in w]
    assert prefill[0] not in {w["worker_id"] for w in live}


@pytest.mark.parametrize("sampling", [
    {"temperature": 0},
    {"temperature": 0.9, "seed": 11, "presence_penalty": 0.3},
], ids=["greedy", "seeded"])  # fmt: skip
def test_a_stream_whose_decode_worker_dies_goes_on_exactly(
    cluster: Cluster, reference: LLM, sampling: dict[str, Any]
) -> None:
    base_url = cluster.deploy(prefill={"replicas": 1, "num_cpus": 0.25},
                              decode={"replicas": 2, "num_cpus": 0.25})  # fmt: skip
    prompt, max_tokens = "the story of a long walk through the hills and the valleys", 1800
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    expected = reference.generate([prompt], params, use_tqdm=False)[0]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    _wait_for_all_answering(cluster)  # (no replica of an earlier test shutting down: the look
    # at the workers mid-stream must not wait for one while the stream runs to its end)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}, **sampling)  # fmt: skip
    chunks = iter(stream)
    texts: list[str] = []
    busy: list[dict[str, Any]] = []
    while not busy:  # (the first token comes from prefill, before decode holds the request)
        texts.extend(c.text for c in next(chunks).choices)
        busy = [w for w in cluster.workers() if w["role"] == "decode" and w.get("num_requests")]
    assert len(busy) == 1, busy  # the one decoding this request, mid-stream
    _kill_replica(busy[0]["worker_id"])
    usage = None
    after_kill = 0
    for chunk in chunks:
        texts.extend(c.text for c in chunk.choices)
        after_kill += bool(chunk.choices)
        usage = chunk.usage or usage
    cluster.config = {}  # the next test deploys afresh (Serve is replacing the replica)
    assert after_kill > 0
    assert "".join(texts) == expected.text
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(expected.prompt_token_ids),
        max_tokens,
    )


def test_one_token_requests_are_served_while_no_decode_worker_is_up(
    cluster: Cluster, reference: LLM
) -> None:
    base_url = cluster.deploy(prefill={"replicas": 1, "num_cpus": 0.25},
                              decode={"replicas": 1, "num_cpus": 0.25})  # fmt: skip
    prompts = [f"a short question, number {i}" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    expected = reference.generate(prompts, params, use_tqdm=False)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

    def one_token(prompt: str) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                        extra_body={"ignore_eos": True}, timeout=20)  # fmt: skip
        assert out.usage is not None and out.usage.completion_tokens == 1
        return out.choices[0].text

    assert one_token(prompts[0]) == expected[0].text
    (decode,) = [w["worker_id"] for w in cluster.workers() if w["role"] == "decode"]
    _kill_replica(decode)
    # No decode worker is up until Serve replaces it (seconds): one-token requests need none.
    texts = [one_token(prompt) for prompt in prompts]
    decode_now = [w for w in cluster.workers() if w["role"] == "decode" and "error" not in w]
    cluster.config = {}  # the next test deploys afresh (Serve is replacing the replica)
    assert texts == [ref.text for ref in expected]
    assert decode_now == []  # (served in the gap: they did not wait for the new decode worker)


def test_the_cluster_outlives_its_worker_registry(cluster: Cluster, reference: LLM) -> None:
    """The registry actor killed for good, then the decode worker: a new registry takes the
    reports (the workers and the router each find it dead and make or find the new one), so
    the router sees the decode worker Serve starts instead and serves on, exactly. Before,
    every request waited a minute and failed with a 503 until a redeploy."""
    base_url = cluster.deploy_pd()
    registries = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("tandem-registry-")]  # fmt: skip
    assert len(registries) == 1, registries
    ray.kill(ray.get_actor(registries[0]["name"], namespace=registries[0]["namespace"]))
    decode = [w["worker_id"] for w in cluster.workers() if w["role"] == "decode"]
    _kill_replica(decode[0])
    cluster.config = {}  # the next test deploys afresh
    deadline = time.monotonic() + 90
    health: dict[str, Any] = {}
    while time.monotonic() < deadline:
        health = requests.get(f"{base_url}/health", timeout=10).json()
        if health.get("workers") == {"prefill": 1, "decode": 1}:
            break
        time.sleep(0.5)
    assert health.get("workers") == {"prefill": 1, "decode": 1}, health
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = reference.generate(["after the registry"], params, use_tqdm=False)[0]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt="after the registry", max_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == expected.text
