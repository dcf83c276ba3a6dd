"""The UCX transport between two processes (see tests/transport_harness.py).

Skipped where `ucxx` (the optional `ucx` extra, `ucxx-cu12`) is not installed. UCX needs no GPU:
on a CPU-only machine it moves data over shared memory and CMA.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="ucxx is not installed (pip install 'tandem-serve[ucx]')")

from tandem.kernels.kv_cache import KVCachePool  # noqa: E402
from tandem.kv_transfer.manifest import TransferError  # noqa: E402
from tandem.kv_transfer.ucx import UcxTransport  # noqa: E402
from tests import transport_deaths as deaths  # noqa: E402
from tests import transport_harness as h  # noqa: E402


@pytest.fixture(scope="module")
def peer() -> Iterator[h.PeerProcess]:
    process = h.PeerProcess()
    yield process
    process.stop()


def test_pages_land_byte_exact(peer: h.PeerProcess) -> None:
    got = h.check_pages_land("ucx", peer)  # dst ids that are one run land in the pool
    assert [r.header["direct"] for r in got] == [True, False, True, False, False]
    assert [r.staged_blocks for r in got] == [0, 3, 0, 4, 2]


def test_pages_land_in_the_pool_unless_opted_out(peer: h.PeerProcess) -> None:
    """Headers with one run of dst ids are written into the pool unless `direct` is False."""
    address, _ = peer.create("ucx", seed=1)
    before = peer.digests()
    sender, pool = h.make_endpoint("ucx", seed=9)
    try:
        src_digests = h.block_digests(pool)
        chunks = [
            ([7], [0], True),
            (list(range(8, 16)), list(range(1, 9)), True),  # consecutive src: pool slice sent
            ([40, 2, 33, 17], [10, 11, 12, 13], True),  # gathered src, direct dst
            ([3, 4], [30, 20], True),  # dst not one run: staged
            (list(range(16, 40)), list(range(24, 48)), False),  # not asked: staged
        ]
        for i, (src, dst, direct) in enumerate(chunks):
            sender.send(address, h.manifest_header(f"d{i}", dst, direct=direct), src)
        got = peer.receive(len(chunks))
        assert [r.header["request_id"] for r in got] == [f"d{i}" for i in range(len(chunks))]
        assert [r.header["direct"] for r in got] == [True, True, True, False, False]
        assert [r.staged_blocks for r in got] == [0, 0, 0, 2, 24]
        expected = list(before)
        for src, dst, _ in chunks:
            for s, d in zip(src, dst, strict=True):
                expected[d] = src_digests[s]
        assert peer.digests() == expected
    finally:
        sender.close()


def test_fifo(peer: h.PeerProcess) -> None:
    h.check_fifo("ucx", peer)


def test_wrong_token_is_refused(peer: h.PeerProcess) -> None:
    h.check_wrong_token("ucx", peer)


def test_frames_of_an_unauthenticated_peer_are_dropped() -> None:
    """A sender that skips waiting for the welcome still cannot deliver headers or write pages."""
    receiver, pool = h.make_endpoint("ucx", seed=1)
    intruder, _ = h.make_endpoint("ucx", "not-the-token", seed=2)
    assert isinstance(intruder, UcxTransport)
    connect = intruder._connect

    def eager_connect(peer: str) -> Any:
        link = connect(peer)
        link.welcomed = True  # pretend the hello was accepted
        return link

    intruder._connect = eager_connect  # type: ignore[method-assign]
    try:
        before = h.block_digests(pool)
        for i in range(3):
            header = h.manifest_header(f"x{i}", [0, 1, 2, 3], direct=True)
            intruder.send(receiver.address, header, [4, 5, 6, 7])
        intruder.send(receiver.address, {"request_id": "x3"})
        assert h.collect(receiver, 1, 1.5) == []
        assert h.block_digests(pool) == before
        # Its frames were taken off UCX's unexpected queue too (they would hold memory until
        # the receiver closes): no frame of any kind is left on any lane.
        deadline = time.monotonic() + 5.0
        while any(unexpected_frames(receiver)):
            assert time.monotonic() < deadline, f"left unreceived: {unexpected_frames(receiver)}"
            time.sleep(0.05)
    finally:
        intruder.close()
        receiver.close()


def unexpected_frames(transport: Any) -> list[bool]:
    """Per lane, whether a frame waits in the worker's unexpected queue (not taken off)."""
    from tandem.kv_transfer._ucx_lanes import ucx_api

    with transport._lock:
        anything = (ucx_api.UCXXTag(0), ucx_api.UCXXTagMask(0), False)
        return [bool(w.tag_probe(*anything).matched) for w in transport._workers]


def test_cancel_drops_queued_sends(peer: h.PeerProcess) -> None:
    h.check_cancel("ucx", peer)


def test_sender_sees_peer_death() -> None:
    started = time.monotonic()
    deaths.check_peer_death("ucx")
    assert time.monotonic() - started < 15  # found by the watch endpoint, not a timeout


def test_timeouts_report_the_request() -> None:
    """A peer that never welcomes us, and one that stops taking pages it is sent, both come
    back as transport_error messages naming the request. (Pages a receiver reads itself are
    not waited for by the sender: the KV protocol's acknowledgements time out instead.)"""
    import ucxx._lib.libucxx as ucx_api

    silent = ucx_api.UCXWorker(ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,)))
    options = {"send_timeout_s": 0.5, "hello_timeout_s": 0.5, "pull": False}
    sender, _ = h.make_endpoint("ucx", options=options)
    receiver, _ = h.make_endpoint("ucx")
    assert isinstance(receiver, UcxTransport)
    try:
        sender.send("ucx:" + silent.address.tobytes().hex(), {"request_id": "t1"})
        (error,) = [m.header for m in h.collect(sender, 1, 5.0)]
        assert error["type"] == "transport_error" and error["request_id"] == "t1"
        assert "no welcome" in error["error"]
        sender.send(receiver.address, {"request_id": "ok"}, [1])
        assert [m.header["request_id"] for m in h.collect(receiver, 1, 5.0)] == ["ok"]
        with receiver._lock:  # its progress thread stalls: the pages are never taken
            sender.send(receiver.address, {"request_id": "t2"}, [2, 3])
            (error,) = [m.header for m in h.collect(sender, 1, 5.0)]
        assert error["request_id"] == "t2" and "timed out" in error["error"]
    finally:
        sender.close()
        receiver.close()


def test_a_killed_senders_process_is_reported_gone_after_its_messages() -> None:
    deaths.check_sender_death_reported("ucx")  # (on one machine: the hello names the pid)


def test_a_sender_that_closes_its_endpoint_and_lives_is_not_reported_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deaths.check_closed_sender_not_reported_gone("ucx", monkeypatch)


def test_close_is_idempotent(peer: h.PeerProcess) -> None:
    h.check_close("ucx", peer)


def test_same_process_round_trip_and_bad_input() -> None:
    a = UcxTransport(h.TOKEN)
    b = UcxTransport(h.TOKEN)
    try:
        pool = KVCachePool(**h.POOL)
        h.fill_pool(pool, 4)
        a.register_pool(pool)
        with pytest.raises(TransferError, match="not in the registered pool"):
            a.send(b.address, {}, [99])
        a.send("ucx:nothex", {"request_id": "bad"})
        (error,) = h.collect(a, 1, 5.0)
        assert error.header["request_id"] == "bad" and "cannot reach" in error.header["error"]
        a.send(b.address, {"n": 1}, [5, 3])
        (m,) = h.collect(b, 1, 5.0)
        assert m.peer == a.address and m.header["n"] == 1 and m.header["direct"] is False
        assert m.pages is not None and m.pages.equal(pool.export_blocks([5, 3]))
    finally:
        a.close()
        b.close()


def test_a_quiet_send_only_endpoint_polls_rarely_and_still_hears_replies() -> None:
    """A prefill worker's endpoint (send-only pool) pauses up to `quiet_sleep_s` while nothing
    of its own is in flight, instead of waking 1,000 times a second; a send wakes it at once,
    and replies still arrive (at most one pause later)."""
    a = UcxTransport(h.TOKEN, quiet_sleep_s=0.05)
    b = UcxTransport(h.TOKEN)
    steps = h.step_counter(a)
    try:
        pool = a.allocate_pool(**h.POOL, send_only=True)
        h.fill_pool(pool, 4)
        a.register_pool(pool)
        a.send(b.address, {"request_id": "r", "n": 1}, [1, 2])
        (m,) = h.collect(b, 1, 5.0)
        assert m.pages is not None and m.pages.equal(pool.export_blocks([1, 2]))
        time.sleep(0.3)  # quiet from here on
        steps[0] = 0
        time.sleep(1.0)
        assert steps[0] <= 60  # ~20 at a 50 ms cap; an endpoint that is not send-only takes ~200
        b.send(a.address, {"type": "ack", "request_id": "r"})
        (reply,) = h.collect(a, 1, 5.0)
        assert reply.header["type"] == "ack"
        # `b` reads `a`'s pages: a send on such a link leaves from the caller's thread, and
        # the polling thread, asleep, is not woken (it would take the GIL from the engine).
        submitted_by: list[str] = []
        submit = a._submit

        def spy(link: Any, msg: Any) -> Any:
            submitted_by.append(threading.current_thread().name)
            return submit(link, msg)

        a._submit = spy  # type: ignore[method-assign]
        for i in range(5):
            time.sleep(0.05)
            a.send(b.address, {"request_id": f"r{i}", "n": 2 + i}, [3 + i])
        got = h.collect(b, 5, 5.0)
        assert [m.header["n"] for m in got] == [2, 3, 4, 5, 6]
        assert all(
            m.pages is not None and m.pages.equal(pool.export_blocks([3 + i]))
            for i, m in enumerate(got)
        )
        assert submitted_by.count(threading.current_thread().name) >= 4, submitted_by
    finally:
        a.close()
        b.close()


def test_pages_of_split_min_bytes_go_half_on_each_lane() -> None:
    """Pages of `split_min_bytes` or more go in two shares, the second over lane 1 (which the
    receiver reads); smaller ones, and any to or from a one-lane endpoint, go whole. Every
    message lands byte-exact."""
    a, b = UcxTransport(h.TOKEN, pull=False), UcxTransport(h.TOKEN)  # (senders send pages)
    one = UcxTransport(h.TOKEN, split_min_bytes=0, pull=False)
    splits = h.posted_pages(b, "split")
    try:
        assert a.address.count(".") == 1 and "." not in one.address
        pools = [KVCachePool(**h.POOL), KVCachePool(**h.POOL)]
        for seed, (transport, pool) in enumerate(zip((a, one), pools, strict=True)):
            h.fill_pool(pool, seed + 3)
            transport.register_pool(pool)
        block_bytes = pools[0].bytes_per_block
        sends = [
            (a, b, list(range(16))),  # 16 blocks: split in the middle
            (a, b, [40, 2, 33, 17, 5]),  # gathered, 5 blocks: split at a 4 KiB boundary
            (a, b, [1, 2, 3]),  # under 256 KiB: whole
            (one, b, list(range(16))),  # from a one-lane sender: whole
            (a, one, list(range(16))),  # to a one-lane receiver: whole
        ]
        for i, (sender, receiver, ids) in enumerate(sends):
            sender.send(receiver.address, {"n": i}, ids)
        # (FIFO per sender; `a`'s and `one`'s messages to `b` may interleave)
        got = sorted(h.collect(b, 4, 5.0), key=lambda m: m.header["n"]) + h.collect(one, 1, 5.0)
        assert [m.header["n"] for m in got] == [0, 1, 2, 3, 4]
        for m, (sender, _, ids) in zip(got, sends, strict=True):
            assert m.pages is not None
            assert m.pages.equal(pools[sender is one].export_blocks(ids))
        halves = [8 * block_bytes, 5 * block_bytes // 2 // 4096 * 4096]
        assert sorted(splits) == list(enumerate([*halves, None, None]))
    finally:
        for transport in (a, b, one):
            transport.close()


def test_an_idle_endpoint_slows_its_polling_after_a_while() -> None:
    """Idle for `SLOW_AFTER_S`, an endpoint pauses up to `slow_sleep_s` between steps (~200
    a second at 5 ms), not `idle_sleep_s` (~1,000 a second at 1 ms)."""
    a = UcxTransport(h.TOKEN)
    steps = h.step_counter(a)
    try:
        time.sleep(0.3)
        steps[0] = 0
        time.sleep(1.0)
        assert 20 <= steps[0] <= 400
    finally:
        a.close()
