"""The UCX transport's pull path: between two processes of one machine the receiver reads the
pages out of the sender's pool itself (`UcxTransport(pull=True)`, see `kv_transfer/ucx.py`).

Skipped where `ucxx` is not installed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="ucxx is not installed (pip install 'tandem-serve[ucx]')")

from tandem.kernels.kv_cache import KVCachePool  # noqa: E402
from tandem.kv_transfer.ucx import UcxTransport  # noqa: E402
from tests import transport_harness as h  # noqa: E402


def test_a_receiver_on_the_same_machine_reads_the_pages_out_of_the_senders_pool() -> None:
    """Where both ends pull (the default) and run on one machine, the sender's frames carry
    only the runs of source blocks, and the receiver reads them (`process_vm_readv`):
    byte-exact, into its pool where the dst ids are one run. A sender or receiver that does not
    pull gets the pages sent. Runs outside the offered pool fail their message alone."""
    a, b, pushing = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN), UcxTransport(h.TOKEN, pull=False)
    metas = h.posted_pages(b, "runs")
    try:
        pools = [a.allocate_pool(**h.POOL, send_only=True), KVCachePool(**h.POOL)]
        b_pool = b.allocate_pool(**h.POOL)
        for seed, (transport, pool) in enumerate([(a, pools[0]), (pushing, pools[1])]):
            h.fill_pool(pool, seed + 5)
            transport.register_pool(pool)
        b.register_pool(b_pool)
        manifest = {"dst_block_ids": [20, 21, 22]}
        a.send(b.address, {"n": 0, "manifest": manifest}, [7, 8, 9])  # one run, into the pool
        a.send(b.address, {"n": 1}, [40, 2, 3, 4, 17])  # three runs, a new tensor
        pushing.send(b.address, {"n": 2}, [5, 6])  # sent: `pushing` offers no pool
        a.send(pushing.address, {"n": 3}, [1, 2])  # sent: `pushing` does not read
        got = sorted(h.collect(b, 3, 5.0), key=lambda m: m.header["n"])
        (to_pushing,) = h.collect(pushing, 1, 5.0)
        assert [m.header["n"] for m in got] == [0, 1, 2] and to_pushing.header["n"] == 3
        assert got[0].pages is None and got[0].header["direct"] is True
        assert b_pool.export_blocks([20, 21, 22]).equal(pools[0].export_blocks([7, 8, 9]))
        assert got[1].pages is not None and got[1].pages.equal(
            pools[0].export_blocks([40, 2, 3, 4, 17])
        )
        assert got[2].pages is not None and got[2].pages.equal(pools[1].export_blocks([5, 6]))
        assert to_pushing.pages is not None and to_pushing.pages.equal(
            pools[0].export_blocks([1, 2])
        )
        assert sorted(metas, key=lambda m: m[0]) == [
            (0, [[7, 3]]),
            (1, [[40, 1], [2, 3], [17, 1]]),
            (2, None),
        ]
        # A sender whose frame names blocks beyond its pool: that message fails, the next lands.
        link = a._links[b.address]
        pools[0].num_blocks += 100  # (only what the frame says changes; the offer does not)
        a.send(b.address, {"request_id": "bad", "n": 4}, [pools[0].num_blocks - 1])
        pools[0].num_blocks -= 100
        a.send(b.address, {"request_id": "good", "n": 5}, [3])
        got = h.collect(b, 2, 5.0)
        assert [m.header.get("type") for m in got] == ["transport_error", None]
        assert (
            got[0].header["request_id"] == "bad"
            and "not in the offered pool" in got[0].header["error"]
        )
        assert got[1].pages is not None and got[1].pages.equal(pools[0].export_blocks([3]))
        assert link.pull and b.address in a._links
    finally:
        for transport in (a, b, pushing):
            transport.close()


def test_a_sender_killed_while_its_pages_are_read_leaves_the_receiver_running() -> None:
    """A sender killed while the receiver reads its 1 MiB chunks: every message handed on has
    exact pages, ``peer_gone`` follows the last of them, and the receiver goes on serving.
    (A read made by UCX itself, as pushed pages of this size are on lane 1, aborts the whole
    process then.)"""
    receiver, _ = h.make_endpoint("ucx")
    expected = KVCachePool(**h.POOL)
    h.fill_pool(expected, 3)
    sender, other = h.PeerProcess(), UcxTransport(h.TOKEN)
    try:
        address, _ = sender.create("ucx", seed=3)
        sender.send(receiver.address, {"request_id": "first"}, [1])
        assert len(h.collect(receiver, 1, 10.0)) == 1
        assert isinstance(receiver, UcxTransport)
        if not any(c.remote is not None for c in receiver._conns.values()):
            pytest.skip("the kernel lets this process read no peer: UCX would abort here")
        for i in range(40):
            sender.send(receiver.address, {"request_id": f"r{i}"}, list(range(16)))
        time.sleep(0.002)
        sender.kill()
        got: list[Any] = []
        deadline = time.monotonic() + 10.0
        while not any(m.header.get("type") == "peer_gone" for m in got):
            assert time.monotonic() < deadline, [m.header for m in got]
            got.extend(receiver.poll(0.05))
        got.extend(receiver.poll(0.3))
        gone = [m.header.get("type") for m in got].index("peer_gone")
        for m in got[gone + 1 :]:  # (after it, only the loss of our own link to it, if any)
            assert m.header.get("type") == "transport_error" and m.header["request_id"] is None
        for m in got[:gone]:
            assert m.peer == address
            if m.header.get("type") is None:
                assert m.pages is not None and m.pages.equal(expected.export_blocks(range(16)))
        other.register_pool(expected)
        other.send(receiver.address, {"request_id": "after"}, [2, 3])
        (after,) = h.collect(receiver, 1, 5.0)
        assert after.pages is not None and after.pages.equal(expected.export_blocks([2, 3]))
    finally:
        sender.stop()
        other.close()
        receiver.close()


def test_a_read_that_fails_fails_its_message_alone() -> None:
    """A read of a sender's pool that the kernel refuses (here: the process is gone) comes
    back as a transport_error naming the request; the transport keeps running."""
    from tandem.kv_transfer._cross_memory import RemotePool

    a, b = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN)
    try:
        pool = KVCachePool(**h.POOL)
        h.fill_pool(pool, 4)
        a.register_pool(pool)
        a.send(b.address, {"request_id": "ok"}, [1])
        assert [m.header["request_id"] for m in h.collect(b, 1, 5.0)] == ["ok"]
        with b._lock:
            (conn,) = b._conns.values()
            assert conn.remote is not None
            gone = 2**22 + 12345  # (over the default pid_max: no such process)
            conn.remote = RemotePool(
                gone,
                *[
                    getattr(conn.remote, f)
                    for f in ("address", "num_blocks", "block_shape", "dtype")
                ],
            )
        a.send(b.address, {"request_id": "lost"}, [4, 5])
        (error,) = [m.header for m in h.collect(b, 1, 5.0)]
        assert error["type"] == "transport_error" and error["request_id"] == "lost"
        assert f"process {gone} is gone" in error["error"]
        b.send(a.address, {"request_id": "reply"})
        assert [m.header["request_id"] for m in h.collect(a, 1, 5.0)] == ["reply"]
    finally:
        a.close()
        b.close()
