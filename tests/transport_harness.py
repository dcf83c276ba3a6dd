"""Two-process helpers for transport tests: a peer process driven over a pipe, and pool checks.

`PeerProcess` spawns (``multiprocessing`` "spawn") a process that holds one transport endpoint
and answers commands: ``create`` an endpoint (with a plain or, for shm, a shared-memory pool
filled with a seed), ``receive`` messages (importing staged pages into its pool, as the protocol's
receiver would), ``digests`` of its pool blocks, ``send``, ``close``. The test process holds the
other endpoint itself (`make_endpoint`). Used by the shm and torch tests (and later ucx).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import xxhash

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer.base import KVTransport, Message
from tandem.kv_transfer.registry import create_transport

TOKEN = "cluster-secret-token"
POOL: dict[str, Any] = {
    "num_blocks": 48,
    "num_layers": 2,
    "block_size": 16,
    "num_kv_heads": 4,
    "head_dim": 64,
}
"""Test pool geometry: 48 blocks of 64 KiB (float32)."""


@dataclass(frozen=True)
class Received:
    """What a peer got: header, whether pages were direct, staged page count, the sender."""

    peer: str
    header: dict[str, Any]
    staged_blocks: int


def fill_pool(pool: KVCachePool, seed: int) -> None:
    """Deterministic, per-seed contents for every block."""
    gen = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen).to(pool.dtype))


def block_digests(pool: KVCachePool) -> list[str]:
    """xxh3-64 of every block's bytes, in block order."""
    raw = pool.tensor.view(torch.uint8).reshape(pool.num_blocks, -1).numpy()
    return [xxhash.xxh3_64_hexdigest(raw[b].tobytes()) for b in range(pool.num_blocks)]


def make_endpoint(
    name: str,
    token: str = TOKEN,
    *,
    shm_pool: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    options: dict[str, Any] | None = None,
) -> tuple[KVTransport, KVCachePool]:
    """An endpoint with a registered, seeded pool of `POOL` geometry (shared memory for shm)."""
    transport = create_transport(name, token, **(options or {}))
    if shm_pool:
        pool = transport.allocate_pool(**POOL, dtype=dtype)  # type: ignore[attr-defined]
    else:
        pool = KVCachePool(**POOL, dtype=dtype)
    fill_pool(pool, seed)
    transport.register_pool(pool)
    return transport, pool


def posted_pages(receiver: Any, field: str) -> list[tuple[Any, Any]]:
    """`(header["n"], meta[field])` of each page description a UCX `receiver` takes, in the
    order it takes them (a spy on its `_post_pages`)."""
    seen: list[tuple[Any, Any]] = []
    post = receiver._post_pages

    def spy(conn_id: int, rx: Any, meta: dict[str, Any], seq: int) -> None:
        seen.append((rx.header["n"], meta.get(field)))
        post(conn_id, rx, meta, seq)

    receiver._post_pages = spy
    return seen


def step_counter(transport: Any) -> list[int]:
    """A one-item list counting a UCX `transport`'s polling steps from now on (set it to 0 to
    reset; a spy on its `_step`)."""
    count = [0]
    original = transport._step

    def counted() -> bool:
        count[0] += 1
        return bool(original())

    transport._step = counted
    return count


def collect(transport: KVTransport, count: int, timeout: float) -> list[Message]:
    """Polls until `count` messages arrived or `timeout` seconds passed."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        out.extend(transport.poll(min(remaining, 0.2)))
    return out


def shm_entries(tag: str) -> list[str]:
    """Names in /dev/shm that contain `tag` (e.g. an endpoint id)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if tag in n)
    except FileNotFoundError:
        return []


def manifest_header(request_id: str, dst: list[int], **extra: Any) -> dict[str, Any]:
    """A minimal header shaped like the protocol's: request id plus manifest dst ids."""
    return {
        "request_id": request_id,
        "manifest": {"request_id": request_id, "dst_block_ids": dst},
        **extra,
    }


# ----------------------------------------------------------------------------- peer process
def _peer_main(pipe: Connection) -> None:
    torch.set_num_threads(1)
    transport: KVTransport | None = None
    pool: KVCachePool | None = None
    while True:
        cmd, args = pipe.recv()
        try:
            if cmd == "create":
                if transport is not None:
                    transport.close()
                name, token, shm_pool, seed, dtype_name, options = args
                dtype = getattr(torch, dtype_name)
                transport, pool = make_endpoint(
                    name, token, shm_pool=shm_pool, seed=seed, dtype=dtype, options=options
                )
                pipe.send(("ok", (transport.address, getattr(transport, "endpoint_id", ""))))
            elif cmd == "receive":
                assert transport is not None and pool is not None
                count, timeout = args
                got = []
                for m in collect(transport, count, timeout):
                    staged = 0
                    if m.pages is not None:
                        staged = int(m.pages.shape[0])
                        dst = m.header.get("manifest", {}).get("dst_block_ids")
                        if dst is not None:
                            pool.import_blocks(dst, m.pages)
                    got.append(Received(m.peer, m.header, staged))
                pipe.send(("ok", got))
            elif cmd == "digests":
                assert pool is not None
                pipe.send(("ok", block_digests(pool)))
            elif cmd == "send":
                assert transport is not None
                peer, header, src = args
                transport.send(peer, header, src)
                pipe.send(("ok", None))
            elif cmd == "close":
                if transport is not None:
                    transport.close()
                    transport.close()
                pipe.send(("ok", None))
            elif cmd == "exit":
                if transport is not None:
                    transport.close()
                pipe.send(("ok", None))
                return
            else:
                pipe.send(("error", f"unknown command {cmd!r}"))
        except Exception as exc:  # reported to the test, which fails with it
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))


class PeerProcess:
    """A spawned process holding one endpoint; each method is one command, answered in order."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def _call(self, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        self._pipe.send((cmd, args))
        if not self._pipe.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout} s")
        status, value = self._pipe.recv()
        if status != "ok":
            raise RuntimeError(f"peer failed {cmd!r}: {value}")
        return value

    def create(
        self,
        name: str,
        token: str = TOKEN,
        *,
        shm_pool: bool = False,
        seed: int = 1,
        dtype: str = "float32",
        options: dict[str, Any] | None = None,
    ) -> tuple[str, str]:
        """Creates the peer's endpoint; returns (address, endpoint_id or "")."""
        result: tuple[str, str] = self._call(
            "create", name, token, shm_pool, seed, dtype, options or {}
        )
        return result

    def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        got: list[Received] = self._call("receive", count, timeout, timeout=timeout + 30)
        return got

    def digests(self) -> list[str]:
        digests: list[str] = self._call("digests")
        return digests

    def send(
        self, peer: str, header: dict[str, Any], src: list[int] | tuple[int, ...] = ()
    ) -> None:
        self._call("send", peer, header, list(src))

    def close_endpoint(self) -> None:
        self._call("close")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
                self._call("exit", timeout=10)
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=10)
        self._pipe.close()


# ------------------------------------------------------------------------ shared checks
def _errors(messages: list[Message]) -> list[dict[str, Any]]:
    return [m.header for m in messages if m.header.get("type") == "transport_error"]


def check_pages_land(
    name: str, peer: PeerProcess, *, shm_pool: bool = False, options: dict[str, Any] | None = None
) -> list[Received]:
    """Chunks of 1, 3, 16 and 4 blocks (64 KiB .. 1 MiB), non-consecutive dst ids and one
    message without a manifest: pages land byte-exact, every other receiver block is untouched.
    Returns what the peer received (callers check which messages were direct). `options` are
    both endpoints' transport options."""
    address, _ = peer.create(name, shm_pool=shm_pool, seed=1, options=options)
    before = peer.digests()
    sender, pool = make_endpoint(name, seed=7, options=options)
    try:
        src_digests = block_digests(pool)
        chunks = [
            ([0], [40]),
            ([1, 2, 3], [5, 9, 6]),
            (list(range(10, 26)), list(range(20, 36))),
            ([30, 4, 31, 32], [0, 1, 2, 44]),
        ]
        for i, (src, dst) in enumerate(chunks):
            sender.send(address, manifest_header(f"r{i}", dst, chunk=i), src)
        sender.send(address, {"request_id": "loose"}, [5, 6])
        got = peer.receive(len(chunks) + 1)
        assert [r.header.get("request_id") for r in got] == ["r0", "r1", "r2", "r3", "loose"]
        assert all(r.peer == sender.address for r in got)
        assert got[-1].staged_blocks == 2 and got[-1].header["direct"] is False
        after = peer.digests()
        expected = list(before)
        for src, dst in chunks:
            for s, d in zip(src, dst, strict=True):
                expected[d] = src_digests[s]
        assert after == expected
        assert not _errors(sender.poll())
        return got
    finally:
        sender.close()


def check_fifo(
    name: str, peer: PeerProcess, *, shm_pool: bool = False, options: dict[str, Any] | None = None
) -> None:
    """20 headers, some carrying pages (direct and staged), arrive in the order sent."""
    address, _ = peer.create(name, shm_pool=shm_pool, options=options)
    sender, _ = make_endpoint(name, options=options)
    try:
        for i in range(20):
            if i % 3 == 0:
                sender.send(address, manifest_header(f"q{i}", [i], seq=i), [i])
            elif i % 3 == 1:
                sender.send(address, {"seq": i, "request_id": f"q{i}"}, [i, i + 2])
            else:
                sender.send(address, {"seq": i})
        got = peer.receive(20)
        assert [r.header["seq"] for r in got] == list(range(20))
        assert peer.receive(1, timeout=0.3) == []
    finally:
        sender.close()


def check_wrong_token(name: str, peer: PeerProcess, *, shm_pool: bool = False) -> None:
    """A sender with another token is refused: it gets a transport_error, the peer gets nothing
    and its pool is unchanged."""
    address, _ = peer.create(name, shm_pool=shm_pool)
    before = peer.digests()
    intruder, _ = make_endpoint(name, "not-the-token", seed=3)
    try:
        intruder.send(address, manifest_header("evil", [0, 1, 2]), [0, 1, 2])
        intruder.send(address, {"request_id": "evil2"})
        errors = _errors(collect(intruder, 1, 10.0))
        assert errors and errors[0]["request_id"] == "evil" and errors[0]["peer"] == address
        assert "evil2" in {e["request_id"] for e in errors + _errors(intruder.poll(0.3))}
        assert peer.receive(1, timeout=0.5) == []
        assert peer.digests() == before
    finally:
        intruder.close()


def check_cancel(
    name: str,
    peer: PeerProcess,
    *,
    shm_pool: bool = False,
    count: int = 120,
    options: dict[str, Any] | None = None,
) -> None:
    """Many queued 1 MiB sends of one request, then `cancel`: the cancelled ones never arrive,
    the rest arrive before a later marker, and nothing of that request follows it. (How many
    are still queued when `cancel` runs depends on the transport thread's speed; on a quiet
    machine it may already have sent them all, which the checks below also accept.)"""
    address, _ = peer.create(name, shm_pool=shm_pool, options=options)
    sender, _ = make_endpoint(name, options=options)
    try:
        src, dst = list(range(16)), list(range(16, 32))
        for i in range(count):
            sender.send(address, manifest_header("big", dst, n=i), src)
        cancelled = sender.cancel("big")
        sender.send(address, {"request_id": "end"})
        assert 0 <= cancelled <= count
        assert sender.cancel("big") == 0
        got = peer.receive(count - cancelled + 1, timeout=20.0)
        ids = [r.header["request_id"] for r in got]
        assert ids == ["big"] * (count - cancelled) + ["end"]
        assert [r.header["n"] for r in got[:-1]] == list(range(count - cancelled))
        assert peer.receive(1, timeout=0.3) == []
        assert not _errors(sender.poll())
    finally:
        sender.close()


def check_close(
    name: str, peer: PeerProcess, *, shm_pool: bool = False, options: dict[str, Any] | None = None
) -> list[str]:
    """Both ends close twice without error after traffic in both directions; sending after close
    raises. Returns the endpoint ids involved (shm: to check /dev/shm is clean)."""
    from tandem.kv_transfer.manifest import TransferError

    address, peer_id = peer.create(name, shm_pool=shm_pool, options=options)
    local, _ = make_endpoint(name, shm_pool=shm_pool, options=options)
    local_id = getattr(local, "endpoint_id", "")
    local.send(address, manifest_header("c1", [1, 2]), [3, 4])
    local.send(address, {"request_id": "c2"}, [5])
    assert len(peer.receive(2)) == 2
    peer.send(local.address, manifest_header("back", [7]), [8])
    assert [m.header["request_id"] for m in collect(local, 1, 10.0)] == ["back"]
    local.close()
    local.close()
    peer.close_endpoint()
    try:
        local.send(address, {"request_id": "late"})
    except TransferError:
        pass
    else:
        raise AssertionError("send after close did not raise")
    return [i for i in (local_id, peer_id) if i]
