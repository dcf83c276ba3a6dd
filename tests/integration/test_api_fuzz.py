"""Random mixes of the API's fields, good and bad, never get a 500 nor a trace: each answer is
200 with a whole body (or a whole SSE stream ending in `[DONE]`) or a 4xx with an OpenAI-style
error (over gRPC: a stream to its last message, or INVALID_ARGUMENT / OUT_OF_RANGE), and
afterwards the workers hold no blocks of them (nothing leaked)."""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import pytest
import requests

from tandem.router.grpc import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import Cluster
from tests.integration.openai_shared import wait_baseline

pytestmark = [pytest.mark.ray, pytest.mark.slow]
DEPLOYMENT = "1x1"  # (conftest groups the tests by deployment)

TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
GOOD: dict[str, list[Any]] = {
    "temperature": [0, 0.7, 1.5],
    "top_p": [0.5, 1.0],
    "top_k": [-1, 1, 20],
    "min_p": [0.0, 0.2],
    "seed": [0, 7, 2**63],
    "max_tokens": [1, 4, 9],
    "min_tokens": [0, 1],
    "stop": ["e", ["a", "b c"]],
    "ignore_eos": [True, False],
    "n": [1, 2],
    "logprobs": None,  # per endpoint
    "presence_penalty": [0.5, -1.0],
    "frequency_penalty": [0.3],
    "repetition_penalty": [1.3],
    "logit_bias": [{"5": 3.0}],
    "allowed_token_ids": [[40, 41, 97, 98]],
    "bad_words": [["ab", "the"]],
    "include_stop_str_in_output": [True],
    "skip_special_tokens": [False],
    "truncate_prompt_tokens": [3, -1],
    "guided_choice": [["yes", "no"]],
    "guided_regex": ["[a-c]{2,4}"],
    "response_format": [{"type": "json_object"}],
    "structured_outputs": [{"grammar": 'root ::= "(" [0-9] ")"'}],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}],
}
BAD: dict[str, list[Any]] = {
    "temperature": [-1, "hot", 9],
    "top_p": [0, 2],
    "top_k": [0],
    "min_p": [1.5],
    "seed": ["x", 2**70],
    "max_tokens": [0, -3, "many", 10**7],
    "n": [0, 500],
    "stop": [5, [""]],
    "logit_bias": [{"x": 1}, {"5": 500}],
    "allowed_token_ids": [[], [10**7]],
    "guided_regex": ["(unclosed"],
    "guided_choice": ["abc", []],
    "structured_outputs": [{"grammar": "root ::= nothing"}, "abc"],
    "response_format": [{"type": "yaml"}],
    "truncate_prompt_tokens": [0, -5],
    "stream_options": [{"include_usage": "yes"}],
}


def _request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"model": "tiny"}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "a b c", "ünï"])}]
        if rng.random() < 0.2:
            body["tools"] = [TOOL]
            body["tool_choice"] = rng.choice(["auto", "required", "none"])
    else:
        body["prompt"] = rng.choice(["hello", [5, 6, 7], ["x y", "z"]])
    for name in rng.sample(sorted(GOOD), rng.randint(1, 6)):
        if name == "logprobs":
            if chat:
                body["logprobs"], body["top_logprobs"] = True, rng.choice([0, 2])
            else:
                body["logprobs"] = rng.choice([0, 3])
        else:
            body[name] = rng.choice(GOOD[name])
    if rng.random() < 0.4:
        name = rng.choice(sorted(BAD))
        body[name] = rng.choice(BAD[name])
    if chat and "max_tokens" not in body:  # (else up to the whole context: ~10 s a request here)
        body["max_completion_tokens"] = 12
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _check(resp: requests.Response, body: dict[str, Any]) -> None:
    what = f"{json.dumps(body)[:400]} -> {resp.status_code} {resp.text[:400]}"
    assert resp.status_code in (200, 400, 404, 413, 422, 429), what
    assert "Traceback" not in resp.text, what
    if resp.status_code != 200:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"], what
        return
    if not body.get("stream"):
        assert resp.json()["choices"], what
        return
    lines = [line for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", what
    for line in lines[:-1]:
        event = json.loads(line[6:])
        assert "error" not in event, what


def test_random_requests_never_fail_the_server(cluster: Cluster) -> None:
    base_url = cluster.deploy_pd(1)
    rng = random.Random(20261130)
    statuses: dict[int, int] = {}
    for _ in range(80):
        path, body = _request(rng)
        resp = requests.post(f"{base_url}{path}", json=body, timeout=60)
        _check(resp, body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 10, statuses
    wait_baseline(cluster, 1)  # every block back: none leaked by any of them


GRPC_OPTIONS: dict[str, list[Any]] = {
    "temperature": [0.0, 1.2, -1.0],
    "top_p": [0.5, 0.0],
    "top_k": [5, 0],
    "min_p": [0.3, 2.0],
    "max_tokens": [3, 0, 10**7],
    "seed": [5],
    "min_tokens": [1, 50],
    "logprobs": [1, 50],
    "presence_penalty": [0.4, 9.0],
    "repetition_penalty": [1.2, 0.0],
    "logit_bias": [{5: 2.0}, {10**7: 1.0}],
    "allowed_token_ids": [[40, 41, 97], [10**7]],
    "bad_words": [["a"], [" "]],
    "json_schema": ['{"type": "object"}', "{not json"],
    "regex": ["[a-c]+", "(unclosed"],
    "choice": [["yes", "no"]],
    "grammar": ['root ::= "x"', "root ::= y"],
    "stop": [["a"]],
    "include_stop_str_in_output": [True],
    "skip_special_tokens": [False],
}
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


def test_random_grpc_requests_never_fail_the_server(cluster: Cluster) -> None:
    """The same over gRPC: each call streams to a last message with a finish reason, or ends
    with INVALID_ARGUMENT / OUT_OF_RANGE."""
    cluster.deploy_pd(1)
    stub = generation_pb2_grpc.GenerationStub(
        grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")
    )
    rng = random.Random(7)
    codes: dict[grpc.StatusCode, int] = {}
    for _ in range(60):
        fields = {n: rng.choice(GRPC_OPTIONS[n]) for n in rng.sample(sorted(GRPC_OPTIONS), 3)}
        prompt = rng.choice(["hello", "a b c"])
        request = generation_pb2.GenerateRequest(
            model="tiny", prompt=prompt, sampling=generation_pb2.SamplingOptions(**fields)
        )
        code = grpc.StatusCode.OK
        try:
            replies = list(stub.Generate(request, timeout=60))
            assert replies and replies[-1].finish_reason, fields
        except grpc.RpcError as exc:
            code = exc.code()
            assert "Traceback" not in (exc.details() or ""), fields
        assert code in GRPC_OK, (fields, code)
        codes[code] = codes.get(code, 0) + 1
    assert codes.get(grpc.StatusCode.OK, 0) >= 8, codes
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 10, codes
    wait_baseline(cluster, 1)
