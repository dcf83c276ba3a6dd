"""The router <-> worker RPC: token handshake, streamed items, errors, cancel on both paths."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.engine.rpc import (
    PROTOCOL,
    RPCClient,
    RPCError,
    RPCNotSent,
    RPCServer,
    _frame,
    _read,
)


class Handlers:
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.noted: list[int] = []
        self.started = asyncio.Event()

    async def count(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"i": i}

    async def forever(self, name: str) -> AsyncIterator[dict[str, Any]]:
        try:
            self.started.set()
            yield {"started": name}
            await asyncio.sleep(3600)
            yield {"never": True}
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise

    async def reply_then_tidy(self) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"ok": True}
            await asyncio.sleep(0.05)  # work after the reply, before the call's end
        except asyncio.CancelledError:
            self.cancelled.append("reply_then_tidy")
            raise

    async def boom(self) -> AsyncIterator[dict[str, Any]]:
        raise ValueError("bad things")
        yield {}

    async def note(self, n: int) -> AsyncIterator[dict[str, Any]]:
        self.noted.append(n)
        yield {"n": n}

    def table(self) -> dict[str, Any]:
        return {
            "note": self.note,
            "count": self.count,
            "forever": self.forever,
            "boom": self.boom,
            "reply_then_tidy": self.reply_then_tidy,
        }


async def _serve(handlers: Handlers) -> tuple[RPCServer, str]:
    server = RPCServer(handlers.table(), "secret")
    return server, await server.start()


def test_stream_call_and_errors() -> None:
    async def main() -> None:
        handlers = Handlers()
        server, address = await _serve(handlers)
        client = RPCClient(address, "secret")
        assert [x["i"] async for x in client.stream("count", n=5)] == [0, 1, 2, 3, 4]
        assert await client.call("count", n=3) == {"i": 0}
        with pytest.raises(RPCError, match="bad things"):
            await client.call("boom")
        with pytest.raises(RPCError, match="unknown method"):
            await client.call("nope")
        results = await asyncio.gather(*(client.call("count", n=i + 1) for i in range(20)))
        assert results == [{"i": 0}] * 20
        await client.close()
        await server.close()

    asyncio.run(main())


def test_calls_reach_the_worker_in_the_order_they_were_made_while_it_connects() -> None:
    """A call that waited for the connection another call was opening is written before any
    call made once it opened (a router's `grant` overtook its `prefill` that way)."""

    async def main() -> None:
        handlers = Handlers()
        server, address = await _serve(handlers)
        client = RPCClient(address, "secret")
        opening = asyncio.create_task(client.call("note", n=0))  # opens the connection
        await asyncio.sleep(0)
        waiting = asyncio.create_task(client.call("note", n=1))  # waits for it
        await asyncio.sleep(0)
        while client._writer is None:
            await asyncio.sleep(0)
        assert await client.call("note", n=2) == {"n": 2}  # made after it opened
        assert [await opening, await waiting] == [{"n": 0}, {"n": 1}]
        assert handlers.noted == [0, 1, 2]
        await client.close()
        await server.close()

    asyncio.run(main())


def test_calls_waiting_for_a_connection_that_fails_all_fail_and_leave_nothing_queued() -> None:
    async def main() -> None:
        probe = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        client = RPCClient(f"127.0.0.1:{port}", "secret")  # nothing listens there now
        results = await asyncio.gather(
            *(client.call("note", n=i) for i in range(3)), return_exceptions=True
        )
        assert [type(r) for r in results] == [RPCNotSent] * 3  # (an RPCError: never written)
        assert client._unsent == [] and client._queues == {}
        assert client.closed and client.lost_at is not None

    asyncio.run(main())


def test_a_unary_call_reads_to_the_end_and_cancels_nothing() -> None:
    async def main() -> None:
        handlers = Handlers()
        server, address = await _serve(handlers)
        client = RPCClient(address, "secret")
        assert await client.call("reply_then_tidy") == {"ok": True}
        await asyncio.sleep(0.1)
        assert handlers.cancelled == []
        await client.close()
        await server.close()

    asyncio.run(main())


def test_wrong_token_is_refused() -> None:
    async def main() -> None:
        server, address = await _serve(Handlers())
        client = RPCClient(address, "guess")
        with pytest.raises(RPCError, match="wrong cluster token"):
            await client.call("count", n=1)
        # a worker that refuses this router's token is of no use to it: taken as lost (its
        # requests go to other workers, `WorkerLost`), not retried for each new request
        assert client.closed and client.lost_at is not None
        await server.close()

    asyncio.run(main())


def test_leaving_a_stream_early_cancels_it_on_the_server() -> None:
    async def main() -> None:
        handlers = Handlers()
        server, address = await _serve(handlers)
        client = RPCClient(address, "secret")
        stream = client.stream("forever", name="a")
        assert await anext(stream) == {"started": "a"}
        await stream.aclose()
        for _ in range(100):
            if handlers.cancelled:
                break
            await asyncio.sleep(0.01)
        assert handlers.cancelled == ["a"]
        await client.close()
        await server.close()

    asyncio.run(main())


def test_a_dropped_connection_cancels_its_calls() -> None:
    async def main() -> None:
        handlers = Handlers()
        server, address = await _serve(handlers)
        client = RPCClient(address, "secret")
        task = asyncio.create_task(anext(client.stream("forever", name="b")))
        assert await task == {"started": "b"}
        await client.close()  # the router went away
        for _ in range(100):
            if handlers.cancelled:
                break
            await asyncio.sleep(0.01)
        assert handlers.cancelled == ["b"]
        await server.close()

    asyncio.run(main())


def test_a_worker_that_is_gone_is_an_rpc_error_and_is_marked_lost() -> None:
    """A connection that breaks (the worker's process died) marks the client lost; a refused
    one (its port is closed) is an RPCError, not an OSError that would reach the API as a
    500; a `close()` of our own marks nothing."""

    async def dies_after_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read(reader)
        writer.write(_frame({"ok": True, "protocol": PROTOCOL}))
        await _read(reader)  # the first call arrives; the process dies before answering
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(dies_after_hello, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = RPCClient(address, "secret")
        with pytest.raises(RPCError, match="lost"):
            await client.call("count", n=1)
        assert client.closed and client.lost_at is not None
        server.close()
        await server.wait_closed()
        refused = RPCClient(address, "secret")
        with pytest.raises(RPCError, match="cannot reach"):
            await refused.call("count", n=1)
        assert refused.closed and refused.lost_at is not None
        ours = RPCClient(address, "secret")
        await ours.close()
        assert ours.closed and ours.lost_at is None

    asyncio.run(main())


def test_the_items_of_one_loop_turn_leave_in_one_write_and_in_order() -> None:
    """32 streams each yielding an item in the same turn (a decode step's tokens): one socket
    write carries them all, and every stream's items still arrive in order."""

    async def main() -> None:
        handlers = Handlers()
        server, address = await _serve(handlers)
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(_frame({"token": "secret", "protocol": PROTOCOL}))
        assert await _read(reader) == {"ok": True, "protocol": PROTOCOL}
        for call_id in range(32):
            writer.write(_frame({"id": call_id, "method": "count", "args": {"n": 3}}))
        await writer.drain()
        seen: dict[int, list[int]] = {i: [] for i in range(32)}
        ends = 0
        while ends < 32:
            message = await asyncio.wait_for(_read(reader), 5)
            if "item" in message:
                seen[message["id"]].append(message["item"]["i"])
            else:
                ends += message.get("end", False)
        assert all(items == [0, 1, 2] for items in seen.values())
        writer.close()
        await server.close()

    writes: list[int] = []
    original = asyncio.selector_events._SelectorSocketTransport.write  # type: ignore[attr-defined]

    def counting(self: Any, data: bytes) -> None:
        writes.append(len(data))
        original(self, data)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asyncio.selector_events._SelectorSocketTransport, "write", counting)  # type: ignore[attr-defined]
        asyncio.run(main())
    # The client's 33 writes (token, 32 calls), then the server's: the handshake reply and a
    # few batched writes for 32 x (3 items + end), not 128.
    server_writes = len(writes) - 33
    assert 2 <= server_writes <= 12, writes


def test_frames_are_msgpack_and_fall_back_to_json_for_integers_beyond_64_bits() -> None:
    async def decode(frame: bytes) -> dict[str, Any]:
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        return await _read(reader)

    token = {"id": 7, "item": {"type": "tokens", "token_ids": [151_643], "text": " déjà"}}
    frame = _frame(token)
    assert frame[4:5] != b"{"  # (msgpack)
    assert asyncio.run(decode(frame)) == token
    bias = {"id": 1, "method": "generate", "args": {"params": {"logit_bias": {5: 3.0}}}}
    assert asyncio.run(decode(_frame(bias))) == bias  # (an int key stays an int)
    hashes = {"id": 2, "item": {"stored": [(1 << 64) - 1], "digest": (1 << 64) - 1}}
    assert asyncio.run(decode(_frame(hashes))) == hashes
    huge = {"id": 3, "args": {"seed": 1 << 70}}
    frame = _frame(huge)
    assert frame[4:5] == b"{"  # (JSON: msgpack's integers end at 64 bits)
    assert asyncio.run(decode(frame)) == huge
    for garbage in (b"\xc1", b"\x92\x01", b"[1]", b"{nope", b"\x81\x91\x01\x02"):
        with pytest.raises(RPCError):
            asyncio.run(decode(len(garbage).to_bytes(4, "big") + garbage))


def test_a_router_and_a_worker_of_different_rpc_protocols_refuse_each_other_clearly() -> None:
    """A JSON-era peer (protocol 1, no "protocol" in its opening frames) is told, in JSON,
    that the versions differ; a router that meets a JSON-era worker says so too."""

    async def main() -> None:
        server, address = await _serve(Handlers())
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b'\x00\x00\x00\x12{"token":"secret"}')  # an old router's opening frame
        reply = await _read(reader)
        assert "protocol 1" in reply["error"] and "tandem versions" in reply["error"]
        writer.close()
        await server.close()

        async def old_worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            hello = await _read(r)  # (JSON: every version reads the opening frame)
            assert hello == {"token": "secret", "protocol": 2}
            w.write(b'\x00\x00\x00\x0b{"ok":true}')
            await w.drain()

        old = await asyncio.start_server(old_worker, "127.0.0.1", 0)
        client = RPCClient(f"127.0.0.1:{old.sockets[0].getsockname()[1]}", "secret")
        with pytest.raises(RPCError, match="different tandem versions"):
            await client.call("count", n=1)
        assert client.closed and client.lost_at is not None
        old.close()

    asyncio.run(main())
