"""The router's own HTTP port: the same OpenAI API app, served by uvicorn in the router replica.

Through Serve's proxy every request and every SSE chunk crosses an extra process (the proxy
actor) and Ray's actor calls. A client that talks to a router replica's own port skips both,
as gRPC clients do. The port is shared by every router replica on a node (`SO_REUSEPORT`: the
kernel spreads connections among them). The app is the very ASGI app Serve runs in this
replica, so routes, middleware (API key, CORS) and error handling are the same. A client that
leaves before its response starts (a non-streamed request, or one still being routed) has its
request cancelled, as Serve's proxy cancels it (`CancelOnDisconnect`); uvicorn alone would let
it run to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("tandem.router")

REQUEST_ID = "x-request-id"


@dataclass
class DirectHTTPServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, lets requests in flight end for up to `grace_s`, then closes."""
        self.server.config.timeout_graceful_shutdown = max(1, math.ceil(grace_s))
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.task), grace_s + 5.0)


class _HTTPWrapper:
    """An ASGI wrapper of `app` for HTTP requests (`http`); anything else goes straight on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class CancelOnDisconnect(_HTTPWrapper):
    """ASGI wrapper: an HTTP request whose client disconnects before the response has started
    is cancelled (its task), as Serve's proxy cancels the replica's call; the app's own
    clean-up (closing the request on its workers, its log line, the abort metric) then runs.
    Once the response has started, the app sees the disconnect itself (a stream's
    `listen_for_disconnect`). The app reads the request's messages through a queue that a
    watcher task fills from the server's `receive`."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        messages: asyncio.Queue[Message] = asyncio.Queue()
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        call = asyncio.ensure_future(self.app(scope, messages.get, sending))

        async def watch() -> None:
            while True:
                message = await receive()
                messages.put_nowait(message)
                if message["type"] == "http.disconnect":
                    if not started:
                        call.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            if call.cancelled():  # the client left: its request was cancelled, not this task
                return
            # This task was cancelled: the server stops and the grace is over (uvicorn logs
            # 'Cancel N running task(s)' once). The call is cancelled too (its clean-up and log
            # line run); returning, not raising, lets uvicorn close the connection with one
            # line instead of a traceback for each request.
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        finally:
            watcher.cancel()


class RequestIds(_HTTPWrapper):
    """ASGI wrapper doing what Serve's proxy does with `X-Request-Id`: a request without one
    gets a new one, and the response carries it back (the app names its response after it)."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = MutableHeaders(scope=scope)
        request_id = headers.get(REQUEST_ID)
        if request_id is None:
            request_id = str(uuid.uuid4())
            headers.append(REQUEST_ID, request_id)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REQUEST_ID, request_id)
            await send(message)

        await self.app(scope, receive, sending)


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):  # (every router replica of the node binds it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def start_direct_http(app: Any, host: str, port: int) -> DirectHTTPServer:
    """Serves `app` (ASGI) on `host:port` (0: a free port) on the running loop."""
    sock = _listening_socket(host, port)
    config = uvicorn.Config(
        CancelOnDisconnect(RequestIds(app)),
        lifespan="off",  # (Serve ran the app's lifespan already)
        log_config=None,
        access_log=False,
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    # Signals stay the replica's: uvicorn would take SIGINT/SIGTERM on a main thread.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # its error
            raise OSError(f"the direct HTTP server on {host}:{port} stopped at start-up")
        await asyncio.sleep(0.01)
    bound = sock.getsockname()[1]
    logger.info("OpenAI API served directly on http://%s:%d/v1", host, bound)
    return DirectHTTPServer(server, task, bound)
