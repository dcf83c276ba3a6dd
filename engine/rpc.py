"""A small async RPC between the router and the workers: msgpack frames over TCP, streamed replies.

Ray Serve handles cost milliseconds per hop; the request path (reserve, prefill, token stream)
needs far less. Every worker runs an `RPCServer`; the router keeps one `RPCClient` per worker.

Wire format: 4-byte big-endian length + a msgpack map, or a UTF-8 JSON object for a message
msgpack cannot hold (an integer beyond 64 bits); a frame starting with `{` is JSON. No pickle;
nothing received is executed. msgpack keeps non-string map keys (JSON would turn a
`logit_bias` {5: 1.0} into {"5": 1.0}; the receiving pydantic models take either), and costs
~0.5 us a token frame each way against ~2.5-3 us for JSON (`json.dumps`/`loads`, here). The
client opens with {"token": ..., "protocol": PROTOCOL} and the server answers {"ok": true,
"protocol": PROTOCOL}, both in JSON, which every version reads: a server that gets the wrong
cluster token or another protocol (a worker and a router of different tandem versions)
answers {"error": ...} and closes. Then, multiplexed by call id:
  client -> {"id": n, "method": name, "args": {...}}  |  {"id": n, "cancel": true}
  server -> {"id": n, "item": {...}} (0..k times), then {"id": n, "end": true} or
            {"id": n, "error": text}
Every method is an async generator; a unary call is a stream of one item. A dropped connection
cancels the calls it carried (a router that dies releases its requests on the workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgpack

logger = logging.getLogger(__name__)

Handler = Callable[..., AsyncIterator[dict[str, Any]]]
_HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20
PROTOCOL = 2  # 1: JSON frames (before 2026-12-05); 2: msgpack frames


class RPCError(RuntimeError):
    """The remote handler failed, the token was refused, or the connection broke."""


class RPCNotSent(RPCError):
    """The call never reached the worker: its connection was closed, or could not be opened,
    before the call was written (so the worker knows nothing of it)."""


async def _read(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise RPCError(f"frame of {size} bytes exceeds the {MAX_FRAME} byte limit")
    data = await reader.readexactly(size)
    try:
        if data[:1] == b"{":
            message = json.loads(data)
        else:
            message = msgpack.unpackb(data, strict_map_key=False)
    except (ValueError, TypeError) as exc:  # (msgpack's errors are ValueErrors)
        raise RPCError(f"a frame that does not decode: {exc}") from None
    if not isinstance(message, dict):
        raise RPCError("a frame must hold a map")
    return message


def _frame(message: dict[str, Any]) -> bytes:
    try:
        data = msgpack.packb(message)
    except OverflowError:  # an integer beyond 64 bits: JSON has no limit
        return _json_frame(message)
    return _HEADER.pack(len(data)) + data


def _json_frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(data)) + data


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _protocol_mismatch(theirs: object) -> str:
    return (
        f"it speaks RPC protocol {theirs}, this process {PROTOCOL}: the router and the workers "
        "run different tandem versions (upgrade every role together)"
    )


def _refusal(hello: dict[str, Any], token: str) -> str | None:
    """Why a server refuses a client's opening frame, or None."""
    if hello.get("token") != token:
        return "wrong cluster token"
    if hello.get("protocol", 1) != PROTOCOL:
        return _protocol_mismatch(hello.get("protocol", 1))
    return None


class _CorkedWriter:
    """A connection's frames written in one `write` per event-loop turn: a decode step's
    token items for 32 streams cost the worker's loop 149 us as 32 socket sends and 17 us as
    one (loopback, here), time its engine thread waits for the GIL. Order is kept; a frame
    waits at most until the loop's next turn."""

    __slots__ = ("_frames", "_loop", "_writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._frames: list[bytes] = []

    def write(self, frame: bytes) -> None:
        if not self._frames:
            self._loop.call_soon(self._flush)
        self._frames.append(frame)

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if self._writer.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            self._writer.write(frames[0] if len(frames) == 1 else b"".join(frames))


class RPCServer:
    def __init__(self, handlers: dict[str, Handler], auth_token: str) -> None:
        if not auth_token:
            raise ValueError("an RPC server needs a non-empty cluster token")
        self.handlers = handlers
        self.auth_token = auth_token
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = f"{host}:{bound[1]}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _no_delay(writer)
        calls: dict[int, asyncio.Task[None]] = {}
        try:
            hello = await asyncio.wait_for(_read(reader), 10)
            refusal = _refusal(hello, self.auth_token)
            if refusal is not None:
                writer.write(_json_frame({"error": refusal}))
                await writer.drain()
                return
            writer.write(_json_frame({"ok": True, "protocol": PROTOCOL}))
            corked = _CorkedWriter(writer)
            while True:
                message = await _read(reader)
                call_id = int(message.get("id", -1))
                if message.get("cancel"):
                    task = calls.pop(call_id, None)
                    if task is not None:
                        task.cancel()
                    continue
                calls[call_id] = asyncio.create_task(self._run(call_id, message, corked, calls))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, RPCError, ValueError):
            pass  # the peer went away or spoke nonsense: drop the connection
        finally:
            for task in calls.values():
                task.cancel()
            writer.close()

    async def _run(
        self,
        call_id: int,
        message: dict[str, Any],
        writer: _CorkedWriter,
        calls: dict[int, asyncio.Task[None]],
    ) -> None:
        handler = self.handlers.get(str(message.get("method")))
        try:
            if handler is None:
                raise RPCError(f"unknown method {message.get('method')!r}")
            async for item in handler(**message.get("args", {})):
                writer.write(_frame({"id": call_id, "item": item}))
            writer.write(_frame({"id": call_id, "end": True}))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("RPC %s failed: %r", message.get("method"), exc)
            writer.write(_frame({"id": call_id, "error": f"{type(exc).__name__}: {exc}"}))
        finally:
            calls.pop(call_id, None)


class RPCClient:
    """One connection to one worker; safe to share between concurrent calls on one loop."""

    def __init__(self, address: str, auth_token: str) -> None:
        self.address = address
        self.auth_token = auth_token
        self._ids = itertools.count()
        self._queues: dict[int, asyncio.Queue[dict[str, Any]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Lock | None = None
        self._unsent: list[bytes] = []
        """Call frames made while the connection was being opened, in call order: they are
        written the moment it opens, before any later call can write its own."""
        self.closed = False
        self.lost_at: float | None = None
        """When the connection failed or broke (`time.time()`); None while it works or after
        `close()`: a worker that dies is seen here first, before its registry entry ages out."""

    async def _connect(self) -> asyncio.StreamWriter:
        if self._writer is not None:
            return self._writer
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None:
                if self.closed:  # (the connection this call waited for failed)
                    raise RPCError(f"connection to {self.address} is closed")
                host, _, port = self.address.rpartition(":")
                try:
                    reader, writer = await asyncio.open_connection(host, int(port))
                    _no_delay(writer)
                    writer.write(_json_frame({"token": self.auth_token, "protocol": PROTOCOL}))
                    reply = await asyncio.wait_for(_read(reader), 10)
                except (OSError, asyncio.IncompleteReadError, TimeoutError, RPCError) as exc:
                    self.closed, self.lost_at = True, time.time()
                    raise RPCError(f"cannot reach {self.address}: {exc!r}") from None
                if not reply.get("ok") or reply.get("protocol", 1) != PROTOCOL:
                    # Another cluster token (a worker of another deployment, e.g. one draining
                    # after a redeploy that changed it) or another tandem: unusable.
                    writer.close()
                    self.closed, self.lost_at = True, time.time()
                    error = reply.get("error") or _protocol_mismatch(reply.get("protocol", 1))
                    raise RPCError(f"{self.address} refused the connection: {error}")
                self._writer = writer
                self._reader_task = asyncio.create_task(self._read_loop(reader))
                # Written in the step that makes the connection usable: a call made later,
                # which finds `_writer` set, cannot overtake them.
                for frame in self._unsent:
                    writer.write(frame)
                self._unsent.clear()
        assert self._writer is not None
        return self._writer

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await _read(reader)
                queue = self._queues.get(int(message.get("id", -1)))
                if queue is not None:
                    queue.put_nowait(message)
        except (asyncio.IncompleteReadError, ConnectionError, RPCError, ValueError):
            pass
        finally:
            if not self.closed:  # the worker went away (close() sets `closed` first)
                self.lost_at = time.time()
            self.closed = True
            self._writer = None
            for queue in self._queues.values():
                queue.put_nowait({"error": f"connection to {self.address} lost"})

    async def stream(self, method: str, **args: Any) -> AsyncGenerator[dict[str, Any], None]:
        """Yields the call's items; leaving early cancels the call on the worker."""
        if self.closed:
            raise RPCNotSent(f"connection to {self.address} is closed")
        call_id = next(self._ids)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[call_id] = queue
        frame = _frame({"id": call_id, "method": method, "args": args})
        done = False
        try:
            # Calls reach the worker in the order they were made, also while the connection
            # opens: a `grant` made after its `prefill` must not arrive first.
            if self._writer is not None:
                self._writer.write(frame)
            else:
                self._unsent.append(frame)
                try:
                    await self._connect()
                except RPCError as exc:
                    if frame in self._unsent:  # (never written)
                        raise RPCNotSent(str(exc)) from None
                    raise
            while True:
                message = await queue.get()
                if "item" in message:
                    yield message["item"]
                    continue
                done = True
                if "error" in message:
                    raise RPCError(str(message["error"]))
                return
        finally:
            del self._queues[call_id]
            if frame in self._unsent:  # (never written: the connection did not open)
                self._unsent.remove(frame)
            elif not done and self._writer is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    self._writer.write(_frame({"id": call_id, "cancel": True}))

    async def call(self, method: str, **args: Any) -> dict[str, Any]:
        """A unary call: the first (only) item. Reads on to the call's end frame (it follows
        the item at once), so the worker is not sent a cancel for a call that already ended."""
        gen = self.stream(method, **args)
        first: dict[str, Any] | None = None
        try:
            async for item in gen:
                if first is None:
                    first = item
        finally:
            await gen.aclose()
        if first is None:
            raise RPCError(f"{method} on {self.address} returned nothing")
        return first

    async def abandon(self, reason: str) -> None:
        """Gives up on a worker whose connection stands but that stopped answering (it hangs):
        its calls in flight fail now as if the connection broke (`lost_at` is set)."""
        self.lost_at = time.time()
        await self.close()
        for queue in self._queues.values():
            queue.put_nowait({"error": f"{self.address} {reason}"})

    async def close(self) -> None:
        self.closed = True
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
