"""What the OpenAI end-to-end modules share: prompts, a client and the wait for idle workers
(the colocated reference and the 1 + 1 / 2 + 2 deployments are fixtures in conftest.py)."""

from __future__ import annotations

import time
from typing import Any

import openai

from tests.integration.conftest import Cluster

WORDS = [
    "prefill",
    "decode",
    "router",
    "cache",
    "block",
    "token",
    "stream",
    "lease",
    "chunk",
    "page",
]
PROMPTS = [
    "hello",
    "The quick brown fox",
    "tandem serves prefill and decode on separate workers",
    "a b c d e f g",
    *(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + 9 * i)) for i in range(10)),
    "ünïcödé ça 語 界 ñ",
    "end.",
]
MAX_TOKENS = 12

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "noop",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
"""Chat tools of the function-calling tests: a weather lookup (its city one of two) and a
function without parameters."""


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def wait_baseline(cluster: Cluster, replicas: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """Every worker back to all blocks free, no request, no reservation, no transfer."""
    deadline = time.monotonic() + timeout
    workers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        workers = cluster.workers()
        roles = [w["role"] for w in workers]
        idle = all(
            w["num_free_blocks"] == w["num_blocks"]
            and w["num_requests"] == 0
            and w.get("num_reservations", 0) == 0
            and w.get("num_transfers", 0) == 0
            for w in workers
        )
        if idle and roles.count("prefill") == replicas and roles.count("decode") == replicas:
            return workers
        time.sleep(0.1)
    raise AssertionError(f"workers did not return to baseline: {workers}")
