"""The gRPC front end without a cluster: health follows the router's readiness, and sampling
options are checked as the HTTP API checks them."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.router.errors import APIError
from tandem.router.grpc import generation_pb2, health_status
from tandem.router.grpc.server import _sampling_fields, start_grpc_server

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
    assert seen == [[SERVING] * 2, [NOT_SERVING] * 2, [SERVING] * 2, [SERVING], [NOT_SERVING]]


def test_sampling_options_are_checked_as_http_checks_them() -> None:
    fields = _sampling_fields(generation_pb2.SamplingOptions(temperature=2.0, top_p=0.1))
    assert fields["temperature"] == 2.0 and fields["top_p"] == 0.1  # (not 0.10000000149...)
    with pytest.raises(APIError) as err:
        _sampling_fields(generation_pb2.SamplingOptions(temperature=2.5))
    assert err.value.status == 400 and err.value.param == "temperature"
    assert "at most 2" in err.value.message
