"""With an API key configured, the OpenAI API and gRPC `Generate` want it; probes do not."""

from __future__ import annotations

import grpc
import openai
import pytest
import requests

from tandem.router.grpc import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KEY = "s3cret-key"
OTHER_KEY = "another-key"  # (several keys, as vLLM's --api-key k1 k2: either passes)


def test_api_key_guards_http_and_grpc_but_not_health_or_metrics(cluster: Cluster) -> None:
    base_url = cluster.deploy(api_key=[KEY, OTHER_KEY])
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    # checked before the body is parsed: a bad body without the key is 401, not 400
    bad = requests.post(f"{base_url}/v1/completions", data="{oops", timeout=30)
    assert bad.status_code == 401
    assert requests.get(f"{base_url}/v1/models", timeout=30).status_code == 401
    assert requests.get(f"{base_url}/debug/workers", timeout=30).status_code == 401
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
    assert requests.get(f"{base_url}/metrics", timeout=30).status_code == 200

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(**body)
    assert out.usage is not None and out.usage.completion_tokens == 3
    # the router's own port guards the same routes (the same app)
    direct = f"{cluster.direct_url}/v1/completions"
    assert requests.post(direct, json=body, timeout=30).status_code == 401
    authorized = {"Authorization": f"Bearer {KEY}"}
    resp = requests.post(direct, json=body, headers=authorized, timeout=30)
    assert resp.json()["choices"][0]["text"] == out.choices[0].text
    assert requests.get(f"{cluster.direct_url}/health", timeout=30).status_code == 200
    other = openai.OpenAI(base_url=f"{base_url}/v1", api_key=OTHER_KEY, max_retries=0)
    assert other.completions.create(**body).choices[0].text == out.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0).models.list()

    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(
        prompt="hello", sampling=generation_pb2.SamplingOptions(temperature=0, max_tokens=3)
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    replies = list(
        stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")])
    )
    assert sum(len(r.token_ids) for r in replies) == 3
    assert [r.text for r in replies if r.finish_reason] != []
    channel.close()
