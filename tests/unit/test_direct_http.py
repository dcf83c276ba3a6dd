"""The router's own HTTP port (`router/direct_http.py`): it serves the app it is given, two
servers share one port, stopping lets a stream in flight end before it closes, and a client
that leaves before its response starts has its request cancelled."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tandem.router.direct_http import start_direct_http


def _app(name: str, chunks: int = 3, gap_s: float = 0.0) -> FastAPI:
    app = FastAPI()

    @app.get("/who")
    async def who() -> dict[str, str]:
        return {"name": name}

    @app.post("/echo")
    async def echo(body: dict[str, int]) -> dict[str, int]:
        return body

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            for i in range(chunks):
                yield f"data: {i}\n\n"
                await asyncio.sleep(gap_s)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_it_serves_the_app_and_streams() -> None:
    async def main() -> None:
        server = await start_direct_http(_app("a"), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{url}/who") as reply:
                assert await reply.json() == {"name": "a"}
            async with client.get(f"{url}/stream") as reply:
                body = await reply.text()
        assert body == "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        await server.stop(1.0)
        assert server.task.done()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as client:
                await client.get(f"{url}/who")

    asyncio.run(main())


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="needs SO_REUSEPORT")
def test_router_replicas_of_one_node_share_the_port() -> None:
    async def main() -> None:
        first = await start_direct_http(_app("a"), "127.0.0.1", 0)
        second = await start_direct_http(_app("b"), "127.0.0.1", first.port)
        assert second.port == first.port
        await first.stop(1.0)  # the other one still answers on the port
        url = f"http://127.0.0.1:{first.port}/who"
        async with aiohttp.ClientSession() as client, client.get(url) as reply:
            assert await reply.json() == {"name": "b"}
        await second.stop(1.0)

    asyncio.run(main())


def test_stopping_lets_a_stream_in_flight_end() -> None:
    async def main() -> None:
        server = await start_direct_http(_app("a", chunks=5, gap_s=0.1), "127.0.0.1", 0)
        async with aiohttp.ClientSession() as client:
            async with client.get(f"http://127.0.0.1:{server.port}/stream") as reply:
                assert await reply.content.readline() == b"data: 0\n"
                stopping = asyncio.ensure_future(server.stop(5.0))
                rest = [line.strip().decode() async for line in reply.content if line.strip()]
            await stopping
        assert rest == ["data: 1", "data: 2", "data: 3", "data: 4", "data: [DONE]"]
        assert server.task.done()

    asyncio.run(main())


def test_a_client_that_leaves_before_the_response_cancels_its_request() -> None:
    """As Serve's proxy does: a non-streamed request whose client gave up (a client-side
    timeout) does not run on to its end (here: a 30 s wait) for nobody."""

    async def main() -> None:
        app = _app("a")
        ended: asyncio.Queue[str] = asyncio.Queue()

        @app.post("/slow")
        async def slow(body: dict[str, int]) -> dict[str, int]:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                ended.put_nowait("cancelled")
                raise
            ended.put_nowait("ran to its end")
            return body

        server = await start_direct_http(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{url}/echo", json={"x": 1}) as reply:
                assert await reply.json() == {"x": 1}  # (the body still reaches the app)
            with pytest.raises(asyncio.TimeoutError):
                timeout = aiohttp.ClientTimeout(total=0.3)
                await client.post(f"{url}/slow", json={"x": 2}, timeout=timeout)
        assert await asyncio.wait_for(ended.get(), 5.0) == "cancelled"
        async with aiohttp.ClientSession() as client, client.get(f"{url}/stream") as reply:
            assert (await reply.text()).endswith("data: [DONE]\n\n")  # (it serves on)
        await server.stop(1.0)

    asyncio.run(main())


def test_a_stream_cut_at_the_end_of_the_grace_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream still open when the grace ends is cut (the client sees the connection close);
    uvicorn says so in one line ('Cancel N running task(s)'): no traceback per request (a
    `tandem serve` Ctrl-C with 16 streams open printed 16 'Exception in ASGI application')."""

    async def main() -> None:
        server = await start_direct_http(_app("a", chunks=100, gap_s=0.1), "127.0.0.1", 0)
        async with aiohttp.ClientSession() as client:
            async with client.get(f"http://127.0.0.1:{server.port}/stream") as reply:
                assert await reply.content.readline() == b"data: 0\n"
                stopping = asyncio.ensure_future(server.stop(1.0))
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for _ in reply.content:
                        pass
            await stopping
        assert server.task.done()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    assert "timeout graceful shutdown exceeded" in caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text
