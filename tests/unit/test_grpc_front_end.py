"""The gRPC front end without a cluster: health follows the router's readiness, and sampling
options are checked as the HTTP API checks them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tandem.router.errors import APIError
from tandem.router.grpc import generation_pb2, health_status
from tandem.router.grpc.server import _sampling_fields, start_grpc_server
from tandem.router.stop_gate import StopGate

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_follows_readiness_and_goes_not_serving_on_stop(monkeypatch: Any) -> None:
    monkeypatch.setattr(health_status, "HEALTH_EVERY_S", 0.05)
    ready = {"now": True}

    async def run() -> list[list[int]]:
        running = await start_grpc_server(
            cast(Any, None), "127.0.0.1", 0, ready=lambda: ready["now"]
        )
        seen = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def check() -> list[int]:
                await asyncio.sleep(0.3)
                replies = [
                    await stub.Check(health_pb2.HealthCheckRequest(service=service))
                    for service in ("", "tandem.v1.Generation")
                ]
                return [reply.status for reply in replies]

            seen.append(await check())
            listed = await stub.List(health_pb2.HealthListRequest())
            seen.append(sorted((k, v.status) for k, v in listed.statuses.items()))
            ready["now"] = False
            seen.append(await check())
            ready["now"] = True
            seen.append(await check())
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            seen.append([(await watch.read()).status])
            await running.stop(0.5)  # a watcher hears NOT_SERVING as the server stops
            seen.append([(await watch.read()).status])
            watch.cancel()
        return seen

    seen = asyncio.run(run())
    listed = [("", SERVING), ("tandem.v1.Generation", SERVING)]
    assert seen == [
        [SERVING] * 2,
        listed,
        [NOT_SERVING] * 2,
        [SERVING] * 2,
        [SERVING],
        [NOT_SERVING],
    ]


def test_sampling_options_are_checked_as_http_checks_them() -> None:
    fields = _sampling_fields(generation_pb2.SamplingOptions(temperature=2.0, top_p=0.1))
    assert fields["temperature"] == 2.0 and fields["top_p"] == 0.1  # (not 0.10000000149...)
    with pytest.raises(APIError) as err:
        _sampling_fields(generation_pb2.SamplingOptions(temperature=2.5))
    assert err.value.status == 400 and err.value.param == "temperature"
    assert "at most 2" in err.value.message
    for name in ("temperature", "top_p", "presence_penalty"):
        with pytest.raises(APIError) as err:
            _sampling_fields(generation_pb2.SamplingOptions(**{name: float("inf")}))
        assert err.value.param == name and "must be a finite number" in err.value.message
    assert _sampling_fields(generation_pb2.SamplingOptions(logprobs=20))["logprobs"] == 20
    for asked in (21, -1):  # (the engine's own bound, and -1 for all, are the offline LLM's)
        with pytest.raises(APIError) as err:
            _sampling_fields(generation_pb2.SamplingOptions(logprobs=asked))
        assert err.value.param == "logprobs" and "must be 0 to 20" in err.value.message


class _Metrics:
    def __init__(self) -> None:
        self.failed_codes: list[str] = []

    def failed(self, code: str) -> None:
        self.failed_codes.append(code)

    def rejected(self, reason: str) -> None:
        raise AssertionError(f"not a refusal at admission: {reason}")


class _RefusingServing:
    """A `Serving` that a request refused before `prepare` must never reach."""

    def __init__(self) -> None:
        self.metrics = _Metrics()

    async def prepare(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("prepare reached")


def test_requests_refused_before_prepare_count_as_failures_as_http_counts_them() -> None:
    # (HTTP counts its 400s in tandem:request_failure_total{code}, malformed bodies included;
    # gRPC refused these without counting them)
    serving = _RefusingServing()
    opts = generation_pb2.SamplingOptions
    refused = [
        generation_pb2.GenerateRequest(prompt="hi", sampling=opts(temperature=5)),
        generation_pb2.GenerateRequest(prompt="hi", sampling=opts(json_schema="[1]")),
        generation_pb2.GenerateRequest(prompt="hi", sampling=opts(regex="a", choice=["a"])),
        generation_pb2.GenerateRequest(prompt="hi", prompt_token_ids=[1]),
        generation_pb2.GenerateRequest(prompt="hi", deadline_ms=0),
        generation_pb2.GenerateRequest(prompt="hi", deadline_ms=float("inf")),
        generation_pb2.GenerateRequest(prompt="hi", request_id="r" * 257),
        generation_pb2.GenerateRequest(prompt="hi", request_id="a\nforged log line"),
    ]

    async def run() -> list[grpc.StatusCode]:
        running = await start_grpc_server(cast(Any, serving), "127.0.0.1", 0)
        codes = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            method = "/tandem.v1.Generation/Generate"
            calls = [r.SerializeToString() for r in refused] + [b"\xff\xff"]  # (+ not a message)
            generate = channel.unary_stream(method)
            for data in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in generate(data):
                        pass
                codes.append(err.value.code())
        await running.stop(0)
        return codes

    codes = asyncio.run(run())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 9
    assert serving.metrics.failed_codes == ["invalid_request_error"] * 9


def test_generate_is_refused_unavailable_once_the_application_stops() -> None:
    serving = _RefusingServing()
    gate = StopGate()
    gate.stopping = True

    async def run() -> tuple[grpc.StatusCode, str]:
        running = await start_grpc_server(cast(Any, serving), "127.0.0.1", 0, gate=gate)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            generate = channel.unary_stream("/tandem.v1.Generation/Generate")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in generate(
                    generation_pb2.GenerateRequest(prompt="hi").SerializeToString()
                ):
                    pass
        await running.stop(0)
        return err.value.code(), err.value.details() or ""

    code, details = asyncio.run(run())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in details
    assert serving.metrics.failed_codes == ["shutting_down"]
    assert gate.in_flight == 0


def test_an_open_health_watch_does_not_hold_the_stop_for_its_whole_grace() -> None:
    # (gRPC clients with client-side health checking keep a Watch open: grpc's own servicer
    # never ends one, so stopping the router waited out the whole drain timeout, 30 s)
    async def run() -> tuple[list[int], float]:
        running = await start_grpc_server(cast(Any, None), "127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            seen = [(await watch.read()).status]
            unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"))
            await unknown.read()
            start = asyncio.get_running_loop().time()
            await running.stop(5.0)
            took = asyncio.get_running_loop().time() - start
            while (reply := await watch.read()) is not grpc.aio.EOF:
                seen.append(reply.status)
            assert await watch.code() == grpc.StatusCode.OK
        return seen, took

    seen, took = asyncio.run(run())
    assert seen == [SERVING, NOT_SERVING]  # (watchers hear NOT_SERVING, then the stream ends)
    assert took < 2.0


def test_reflection_lists_the_services_and_describes_generate() -> None:
    # (grpcurl, Postman and Evans find the services and message types through it, without the proto)
    loop = asyncio.new_event_loop()
    running = loop.run_until_complete(start_grpc_server(cast(Any, None), "127.0.0.1", 0))
    threading.Thread(target=loop.run_forever, daemon=True).start()  # (the client below blocks)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = sorted(database.get_services())
            pool = DescriptorPool(database)
            method = pool.FindServiceByName("tandem.v1.Generation").methods_by_name["Generate"]
            shape = (method.input_type.full_name, method.output_type.full_name)
            streams = method.server_streaming
            v1 = channel.stream_stream(  # (the current name, which v1-only clients ask)
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            asked = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            listed = [s.name for r in v1(asked) for s in r.list_services_response.service]
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(0), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
    assert services == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "tandem.v1.Generation",
    ]
    assert shape == ("tandem.v1.GenerateRequest", "tandem.v1.GenerateResponse") and streams
    assert sorted(listed) == services


def test_the_last_message_names_what_stopped_the_request() -> None:
    """vLLM's stop_reason: a stop string, a stop token id, or neither (the tokenizer's EOS)."""
    from types import SimpleNamespace

    from tandem.router.grpc.server import _response

    item = {"token_ids": [5], "text": "x", "finish_reason": "stop"}
    for stop, which in (("\n", "stop_string"), (7, "stop_token_id"), (None, None)):
        req = SimpleNamespace(
            prompt_token_ids=[1, 2],
            completion_tokens=1,
            num_cached_tokens=0,
            request_id="r1@x",
            stop_reason=stop,
        )
        reply = _response("r1", cast(Any, req), item)
        assert reply.WhichOneof("stop_reason") == which
        if which is not None:
            assert getattr(reply, which) == stop
        running = _response("r1", cast(Any, req), {**item, "finish_reason": None})
        assert running.WhichOneof("stop_reason") is None and not running.HasField("usage")
