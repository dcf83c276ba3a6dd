"""gRPC statuses that say what happened: a long refusal is cut (a message over gRPC's metadata
limits came out as RESOURCE_EXHAUSTED, "retry later"), a request over 4 MiB is read (it was
RESOURCE_EXHAUSTED too), a schema nested too deeply is INVALID_ARGUMENT (it was UNKNOWN, with
the internal exception), an unexpected error is INTERNAL without its details, and a grammar is
checked off the event loop, as HTTP checks it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from tandem.router.grpc import generation_pb2, server
from tandem.router.grpc.server import MAX_STATUS_MESSAGE, start_grpc_server
from tests.unit.fake_serving import fake_serving


def _call(serving: Any, request: generation_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    async def run() -> tuple[grpc.StatusCode, str]:
        running = await start_grpc_server(cast(Any, serving), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{running.port}",
                options=[("grpc.max_send_message_length", 64 << 20)],
            ) as channel:
                generate = channel.unary_stream("/tandem.v1.Generation/Generate")
                try:
                    async for _ in generate(request.SerializeToString()):
                        pass
                except grpc.aio.AioRpcError as err:
                    return err.code(), err.details() or ""
                return grpc.StatusCode.OK, ""
        finally:
            await running.stop(0)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def serving(tiny_checkpoint: Callable[..., Path]) -> Any:
    return fake_serving(tiny_checkpoint(), "{{ messages[0]['content'] }}")


def test_a_refusal_that_quotes_a_huge_field_keeps_its_status(serving: Any) -> None:
    code, details = _call(serving, generation_pb2.GenerateRequest(prompt="hi", model="m" * 20000))
    assert code == grpc.StatusCode.NOT_FOUND and len(details) <= MAX_STATUS_MESSAGE
    emoji = generation_pb2.SamplingOptions(
        json_schema='{"type": "integer", "const": "%s"}' % ("😀" * 1990)
    )
    code, details = _call(serving, generation_pb2.GenerateRequest(prompt="hi", sampling=emoji))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # (cut by bytes: 2,000 emoji were 23 KB)
    assert len(details.encode()) <= MAX_STATUS_MESSAGE
    bias = generation_pb2.SamplingOptions(logit_bias={i: 1e30 for i in range(500)})
    code, details = _call(serving, generation_pb2.GenerateRequest(prompt="hi", sampling=bias))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 500


def test_a_request_over_4_mib_gets_the_status_of_what_is_wrong_with_it(serving: Any) -> None:
    code, details = _call(serving, generation_pb2.GenerateRequest(prompt="a " * (5 << 19)))
    assert code == grpc.StatusCode.OUT_OF_RANGE, details


def test_a_schema_nested_too_deeply_is_invalid_argument(serving: Any) -> None:
    nested = '{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000
    for schema in ("[" * 100000, nested):
        options = generation_pb2.SamplingOptions(json_schema=schema)
        code, details = _call(
            serving, generation_pb2.GenerateRequest(prompt="hi", sampling=options)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "nested too deeply" in details


def test_an_unexpected_error_is_internal_without_its_details(
    serving: Any, monkeypatch: Any
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("secret internals")

    monkeypatch.setattr(serving, "prepare", broken)
    counted = serving.metrics.registry.get_sample_value(
        "tandem:request_failure_total", {**serving.metrics.labels, "code": "server_error"}
    )
    code, details = _call(serving, generation_pb2.GenerateRequest(prompt="hi"))
    assert (code, details) == (grpc.StatusCode.INTERNAL, "internal error: KeyError")
    after = serving.metrics.registry.get_sample_value(
        "tandem:request_failure_total", {**serving.metrics.labels, "code": "server_error"}
    )
    assert (after or 0) - (counted or 0) == 1  # (counted, as HTTP's 500s)


def test_a_grammar_is_checked_off_the_event_loop(serving: Any, monkeypatch: Any) -> None:
    threads: list[str] = []
    checked = server._sampling_fields  # noqa: SLF001

    def recording(options: Any) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return checked(options)

    monkeypatch.setattr(server, "_sampling_fields", recording)
    for options in (
        generation_pb2.SamplingOptions(regex="[ab]+"),
        generation_pb2.SamplingOptions(temperature=0.5),
    ):
        _call(serving, generation_pb2.GenerateRequest(prompt="hi", sampling=options))
    assert threads[0].startswith("tokenize") and threads[1] == "MainThread"
