"""A gRPC call's trailing metadata carries its id and stage timings, as HTTP's headers do
(`x-request-id`, `x-tandem-timings`); a call without `request_id` may name itself with
`x-request-id` metadata (it was ignored, and nothing came back in metadata)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import grpc

from tandem.router.errors import APIError
from tandem.router.grpc import generation_pb2
from tandem.router.grpc.server import start_grpc_server
from tandem.router.request_timings import RequestTimings


class _Serving:
    def __init__(self) -> None:
        self.metrics = SimpleNamespace(failed=lambda code: None, rejected=lambda why: None)
        self.ids: list[str] = []

    async def prepare(self, request_id: str, model: Any, prompt: Any, *args: Any, **kw: Any) -> Any:
        if prompt == "refuse":
            raise APIError(429, "queue full", type="rate_limit_error")
        self.ids.append(request_id)
        timings = RequestTimings(arrival=100.0)
        timings.marks.update(tokenized=100.001, first_token=100.004, finished=100.010)
        return SimpleNamespace(
            request_id=request_id, timings=timings, prompt_token_ids=[1, 2], completion_tokens=1,
            num_cached_tokens=0, stop_reason=None,
        )  # fmt: skip

    async def run(self, req: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"token_ids": [7], "text": "x", "finish_reason": "length"}


def test_trailing_metadata_names_the_call_and_its_timings() -> None:
    serving = _Serving()

    async def run() -> list[Any]:
        running = await start_grpc_server(cast(Any, serving), "127.0.0.1", 0)
        seen = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            generate = channel.unary_stream(
                "/tandem.v1.Generation/Generate",
                request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                response_deserializer=generation_pb2.GenerateResponse.FromString,
            )
            for request, metadata in (
                (generation_pb2.GenerateRequest(prompt="a", request_id="mine"), ()),
                (generation_pb2.GenerateRequest(prompt="b"), (("x-request-id", "from-meta"),)),
                (generation_pb2.GenerateRequest(prompt="c"), ()),
                (generation_pb2.GenerateRequest(prompt="d", request_id="été"), ()),
            ):
                call = generate(request, metadata=metadata)
                replies = [reply async for reply in call]
                seen.append((replies[-1].request_id, dict(await call.trailing_metadata())))
            call = generate(generation_pb2.GenerateRequest(prompt="refuse", request_id="r"))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                seen.append((exc.code(), dict(exc.trailing_metadata() or ())))
            # an id refused for its length is not echoed: gRPC refuses headers past 16 KiB
            # (RESOURCE_EXHAUSTED, "retry later": the call could never succeed)
            call = generate(generation_pb2.GenerateRequest(prompt="e", request_id="x" * 20000))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                seen.append((exc.code(), dict(exc.trailing_metadata() or ())))
        await running.stop(0)
        return seen

    (mine, meta, none, accented, refused, too_long) = asyncio.run(run())
    assert mine[0] == "mine" and mine[1]["x-request-id"] == "mine"
    timings = json.loads(mine[1]["x-tandem-timings"])
    assert timings == {"tokenize": 1.0, "ttft": 4.0, "decode_stream": 6.0, "e2e": 10.0}
    assert meta[0] == "from-meta" and meta[1]["x-request-id"] == "from-meta"
    assert serving.ids[1].startswith("from-meta@")
    assert none[0].startswith("grpc-") and none[1]["x-request-id"] == none[0]
    assert accented[0] == "été" and "x-request-id" not in accented[1]  # (not ASCII)
    assert refused == (grpc.StatusCode.RESOURCE_EXHAUSTED, {"x-request-id": "r"})
    assert too_long == (grpc.StatusCode.INVALID_ARGUMENT, {})
