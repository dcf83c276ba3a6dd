"""The floor under any Python gRPC front end on this machine: a bare `grpc.aio` server in another
process that answers tandem's `Generate` with one message at once, timed the way
`bench/overhead.py` times the cluster (request sent -> first message in), with the same pause
before each request. Whatever the cluster adds beyond this and beyond the engine's own prefill
is the router, the worker hops and the hand-offs inside the workers.

    python -m bench.grpc_floor --requests 200 --idle-ms 38
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int) -> None:
    import grpc

    from tandem.router.grpc import generation_pb2, generation_pb2_grpc

    class Echo(generation_pb2_grpc.GenerationServicer):
        async def Generate(  # noqa: N802 - the RPC's name
            self, request: Any, context: Any
        ) -> AsyncIterator[Any]:
            yield generation_pb2.GenerateResponse(request_id="floor", token_ids=[1], text="a")

    async def main() -> None:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(Echo(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def measure(prompt: list[int], requests: int, idle_s: float) -> list[float]:
    """Seconds from sending each request to its first message, after `idle_s` of quiet."""
    import grpc

    from tandem.router.grpc import generation_pb2, generation_pb2_grpc

    port = _free_port()
    process = mp.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    process.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt)
        times = []
        for i in range(requests + 3):  # 3 to warm up
            time.sleep(idle_s)
            start = time.perf_counter()
            replies = stub.Generate(request)
            next(replies)
            if i >= 3:
                times.append(time.perf_counter() - start)
            for _ in replies:
                pass
        channel.close()
        return times
    finally:
        process.terminate()
        process.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--idle-ms", type=float, default=0.0, help="pause before each request")
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    times = measure(list(range(10, 10 + args.prompt_len)), args.requests, args.idle_ms / 1e3)
    print(f"bare gRPC first message p50 {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
