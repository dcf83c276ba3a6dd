"""gRPC: `Generate` streams the same tokens as the colocated `LLM`; health reports SERVING."""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.router.grpc import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]
DEPLOYMENT = "1x1"  # (conftest groups the tests by deployment)


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> grpc.Channel:
    cluster.deploy_pd(1)
    ch = grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")
    grpc.channel_ready_future(ch).result(timeout=30)
    return ch


def test_health_reports_serving(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Generation"):
        deadline = time.monotonic() + 10
        while True:
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_generate_streams_the_same_tokens(channel: grpc.Channel, cluster: Cluster) -> None:
    llm = LLM(model=str(cluster.model), num_kv_blocks=256)
    stub = generation_pb2_grpc.GenerationStub(channel)
    cases = [("hello grpc", 10), ("tandem streams tokens over grpc " * 5, 10), ("one", 1)]
    for prompt, n in cases:  # (one token: it ends on the prefill worker)
        exp = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )[0]
        request = generation_pb2.GenerateRequest(
            model="tiny",
            prompt=prompt,
            sampling=generation_pb2.SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True),
        )
        replies = list(stub.Generate(request, timeout=60))
        assert [t for r in replies for t in r.token_ids] == exp.token_ids
        assert "".join(r.text for r in replies) == exp.text
        assert replies[-1].finish_reason == "length"
        assert replies[-1].usage.completion_tokens == n
        assert replies[-1].usage.prompt_tokens == len(exp.prompt_token_ids)
    exp = llm.generate(
        [cases[1][0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    ids_request = generation_pb2.GenerateRequest(
        prompt_token_ids=exp.prompt_token_ids,
        sampling=generation_pb2.SamplingOptions(temperature=0, max_tokens=10, ignore_eos=True),
    )
    assert [t for r in stub.Generate(ids_request, timeout=60) for t in r.token_ids] == exp.token_ids


def test_generate_refuses_bad_input(channel: grpc.Channel) -> None:
    stub = generation_pb2_grpc.GenerationStub(channel)
    cases = [
        (generation_pb2.GenerateRequest(model="nope", prompt="x"), grpc.StatusCode.NOT_FOUND),
        (generation_pb2.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
        (
            generation_pb2.GenerateRequest(
                prompt="x", sampling=generation_pb2.SamplingOptions(max_tokens=0)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (generation_pb2.GenerateRequest(prompt="word " * 3000), grpc.StatusCode.OUT_OF_RANGE),
        (
            generation_pb2.GenerateRequest(prompt="a deadline nobody can meet", deadline_ms=0.001),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            generation_pb2.GenerateRequest(prompt="x", deadline_ms=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            generation_pb2.GenerateRequest(prompt="x", prompt_token_ids=[1, 2]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            generation_pb2.GenerateRequest(
                prompt="x", sampling=generation_pb2.SamplingOptions(max_tokens=2, min_tokens=3)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    for request, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
        assert info.value.code() == code


def test_bytes_that_are_no_request_are_invalid_argument(channel: grpc.Channel) -> None:
    raw = channel.unary_stream("/tandem.v1.Generation/Generate")  # (bytes as they are)
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\xff\xff\xff\xff", timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_two_calls_with_one_request_id_both_run(channel: grpc.Channel) -> None:
    """A client's request id may repeat while the first call runs: each call is its own
    request on the workers (the id comes back as the client gave it)."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    greedy = generation_pb2.SamplingOptions(temperature=0, max_tokens=40, ignore_eos=True)
    first = stub.Generate(
        generation_pb2.GenerateRequest(
            prompt="one id, two calls", request_id="dup", sampling=greedy
        ),
        timeout=60,
    )
    replies = [next(first)]  # the first call is streaming
    short = generation_pb2.SamplingOptions(temperature=0, max_tokens=3, ignore_eos=True)
    second = list(stub.Generate(
        generation_pb2.GenerateRequest(prompt="another", request_id="dup", sampling=short),
        timeout=60,
    ))  # fmt: skip
    assert sum(len(r.token_ids) for r in second) == 3
    replies += list(first)
    assert sum(len(r.token_ids) for r in replies) == 40
    assert {r.request_id for r in replies + second} == {"dup"}


def test_generate_with_penalties_bias_and_logprobs(channel: grpc.Channel, cluster: Cluster) -> None:
    llm = LLM(model=str(cluster.model), num_kv_blocks=256)
    prompt = "penalties and logprobs over grpc"
    fields = {
        "temperature": 0,
        "max_tokens": 10,
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.4,
        "logit_bias": {9: 3.0},
        "logprobs": 2,
    }
    exp = llm.generate([prompt], SamplingParams(**fields), use_tqdm=False)[0]  # type: ignore[arg-type]
    assert exp.logprobs is not None
    options = generation_pb2.SamplingOptions(**fields)  # type: ignore[arg-type]
    replies = list(stub_generate(channel, prompt, options))
    assert [t for r in replies for t in r.token_ids] == exp.token_ids
    got = [e for r in replies for e in r.logprobs]
    assert len(got) == len(exp.logprobs) == 10
    for entry, (lp, top) in zip(got, exp.logprobs, strict=True):
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert [t.token_id for t in entry.top] == [t for t, _ in top]


def stub_generate(
    channel: grpc.Channel, prompt: str, options: generation_pb2.SamplingOptions
) -> list[generation_pb2.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(model="tiny", prompt=prompt, sampling=options)
    return list(stub.Generate(request, timeout=60))


def test_generate_follows_a_json_schema(channel: grpc.Channel, cluster: Cluster) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    options = generation_pb2.SamplingOptions(
        temperature=0, max_tokens=20, json_schema=json.dumps(schema)
    )
    replies = stub_generate(channel, "pick", options)
    assert json.loads("".join(r.text for r in replies)) in ("yes", "no")
    assert replies[-1].finish_reason == "stop"
    bad = generation_pb2.SamplingOptions(max_tokens=2, json_schema="{not json")
    with pytest.raises(grpc.RpcError) as info:
        stub_generate(channel, "pick", bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_follows_a_regex_a_choice_or_a_grammar(
    channel: grpc.Channel, cluster: Cluster
) -> None:
    checks = [
        ({"regex": "[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
        ({"choice": ["up", "down", "left"]}, lambda t: t in ("up", "down", "left")),
        ({"grammar": 'root ::= "<" [a-c]+ ">"'}, lambda t: re.fullmatch("<[a-c]+>", t)),
    ]
    for fields, check in checks:
        options = generation_pb2.SamplingOptions(temperature=0, max_tokens=20, **fields)
        replies = stub_generate(channel, "pick", options)
        text = "".join(r.text for r in replies)
        assert check(text) and replies[-1].finish_reason == "stop", (fields, text)
    for bad in (
        generation_pb2.SamplingOptions(max_tokens=2, regex="(unclosed"),
        generation_pb2.SamplingOptions(max_tokens=2, regex="a", choice=["b"]),
    ):
        with pytest.raises(grpc.RpcError) as info:
            stub_generate(channel, "pick", bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
