"""The UCX transport between two endpoints of one machine that pull: a stream's plain chunks go
as compact records (`_ucx_frames.send_chunk_record`), and a receiver whose senders all ring its
doorbell sleeps on it instead of polling (`UcxTransport._rung_only`, `_doorbell.py`).

Skipped where `ucxx` is not installed.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytest.importorskip("ucxx", reason="ucxx is not installed (pip install 'tandem-serve[ucx]')")

from tandem.kv_transfer import _ucx_replies, ucx  # noqa: E402
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter  # noqa: E402
from tandem.kv_transfer.ucx import UcxTransport  # noqa: E402
from tests import transport_harness as h  # noqa: E402


def records_taken(receiver: UcxTransport) -> list[int]:
    """The first byte of each compact record `receiver` takes, in order (a spy)."""
    seen: list[int] = []
    on_layout, chunk_message = receiver._on_layout, receiver._chunk_message

    def layout_spy(conn: Any, raw: bytes) -> None:
        seen.append(raw[0])
        on_layout(conn, raw)

    def chunk_spy(conn: Any, raw: bytes) -> Any:
        seen.append(raw[0])
        return chunk_message(conn, raw)

    receiver._on_layout = layout_spy  # type: ignore[method-assign]
    receiver._chunk_message = chunk_spy  # type: ignore[method-assign]
    return seen


def pull_pair(a: UcxTransport, b: UcxTransport, filled: int) -> tuple[Any, Any, PagesHeaderWriter]:
    """`a` (send-only, its pool filled with `filled`) and `b` with pools registered, and a
    header writer for `a`'s layout."""
    a_pool, b_pool = a.allocate_pool(**h.POOL, send_only=True), b.allocate_pool(**h.POOL)
    h.fill_pool(a_pool, filled)
    a.register_pool(a_pool)
    b.register_pool(b_pool)
    return a_pool, b_pool, PagesHeaderWriter(KVLayout.of_pool(a_pool, "ns-1"))


def test_plain_chunks_go_as_compact_records_and_arrive_as_their_json_says() -> None:
    a, b = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN)
    seen = records_taken(b)
    try:
        a_pool, b_pool, writer = pull_pair(a, b, 3)

        def chunk(rid: str, index: int, src: list[int], dst: list[int]) -> Any:
            return writer.plain_chunk(rid, index, 16 * (index + 1), src, dst)

        a.send(b.address, {"n": 0}, [1])  # (the link, welcomed: later frames are pulled)
        h.collect(b, 1, 5.0)
        sent = [
            chunk("r-1", 0, [7, 8, 9], [20, 21, 22]),  # one run: into the pool
            chunk("r-1", 1, [30, 2, 31], [23, 24, 25]),  # three runs of src ids, one of dst
            chunk("r-2", 0, [4, 5], [40, 42]),  # dst not one run: a new tensor
        ]
        for header in sent:
            a.send(b.address, header, header["manifest"]["src_block_ids"])
        other = chunk("r-3", 0, [1, 2], [10, 11])
        a.send(b.address, other, [3, 4])  # ids other than the manifest's: JSON
        got = h.collect(b, 4, 5.0)
        assert seen == [ord("L"), ord("C"), ord("C"), ord("C")]  # the layout once
        for message, header in zip(got, [*sent, other], strict=True):
            assert message.header == {**json.loads(header.text), "direct": message.pages is None}
        assert [m.pages is None for m in got] == [True, True, False, True]
        for dst, src in [
            ([20, 21, 22], [7, 8, 9]),
            ([23, 24, 25], [30, 2, 31]),
            ([10, 11], [3, 4]),
        ]:
            assert b_pool.export_blocks(dst).equal(a_pool.export_blocks(src))
        assert got[2].pages is not None and got[2].pages.equal(a_pool.export_blocks([4, 5]))
    finally:
        a.close()
        b.close()


def test_a_receiver_whose_senders_ring_sleeps_until_rung(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bell's sleep at 60 s, a receiver whose sender rang it steps at most a few times
    in an idle second (polling, it steps hundreds), yet takes each frame within seconds: its
    sender rings. A sender that pushes puts it back to polling."""
    monkeypatch.setattr(ucx, "RUNG_SLEEP_S", 60.0)
    a, b, pushing = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN), UcxTransport(h.TOKEN, pull=False)
    steps = h.step_counter(b)
    try:
        for transport in (a, b, pushing):
            pool = transport.allocate_pool(**h.POOL)
            h.fill_pool(pool, 1)
            transport.register_pool(pool)
        a.send(b.address, {"n": 0}, [1])
        h.collect(b, 1, 5.0)
        for n in (1, 2, 3):
            time.sleep(0.5)  # (b's thread falls asleep on its bell)
            before = steps[0]
            time.sleep(1.0)
            assert steps[0] - before <= 3
            with b._lock:
                assert b._rung_only()
            start = time.monotonic()
            a.send(b.address, {"n": n}, [n])
            (message,) = h.collect(b, 1, 30.0)
            assert message.header["n"] == n and time.monotonic() - start < 10.0
        pushing.send(b.address, {"n": 4}, [2])
        (message,) = h.collect(b, 1, 30.0)
        with b._lock:
            assert message.header["n"] == 4 and not b._rung_only()
    finally:
        for transport in (a, b, pushing):
            transport.close()


def test_a_sender_whose_rings_do_not_arrive_leaves_the_receiver_polling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sender that pulls but whose rings never reach the receiver (another network namespace,
    an address written otherwise): the receiver never sleeps on its bell, so with that sleep at
    60 s each frame still comes within seconds."""
    monkeypatch.setattr(ucx, "RUNG_SLEEP_S", 60.0)
    a, b = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN)
    ring = a._bell.ring  # (its own bell still rings: `close` wakes its thread so)
    monkeypatch.setattr(a._bell, "ring", lambda name: ring(name) if name == a._bell.name else None)
    try:
        for transport in (a, b):
            pool = transport.allocate_pool(**h.POOL)
            h.fill_pool(pool, 1)
            transport.register_pool(pool)
        for n in range(3):
            a.send(b.address, {"n": n}, [n])
            start = time.monotonic()
            (message,) = h.collect(b, 1, 30.0)
            assert message.header["n"] == n and time.monotonic() - start < 10.0
            assert a._links[b.address].pull
            with b._lock:
                assert not b._rung_only()
            time.sleep(0.3)
    finally:
        a.close()
        b.close()


def test_acks_and_renewals_ring_no_bell() -> None:
    """The protocol's acknowledgements and lease renewals wait for the receiver's next look
    (`ucx.UNHURRIED`); every other message on a pull link rings."""
    a, b = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN)
    rung: list[bytes] = []
    ring = a._bell.ring

    def spy(name: bytes) -> None:
        if name == b._bell.name:  # (not `a` waking its own thread)
            rung.append(name)
        ring(name)

    a._bell.ring = spy  # type: ignore[method-assign]
    try:
        for transport in (a, b):
            pool = transport.allocate_pool(**h.POOL)
            transport.register_pool(pool)
        a.send(b.address, {"type": "pages", "n": 0}, [1])
        h.collect(b, 1, 5.0)
        for kind in ("ack", "renew", "cancel", "pages"):
            deadline = time.monotonic() + 5.0
            while a._links[b.address].inflight and time.monotonic() < deadline:
                time.sleep(0.01)  # (a frame still in UCX's hands is rung for again)
            rung.clear()
            a.send(b.address, {"type": kind, "request_id": "r1"})
            (message,) = h.collect(b, 1, 5.0)
            time.sleep(0.05)
            assert message.header["type"] == kind
            assert (len(rung) == 0) == (kind in ("ack", "renew")), (kind, rung)
    finally:
        a.close()
        b.close()


def test_the_ack_of_a_requests_last_chunk_is_taken_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender that would sleep 60 s on its bell or as a quiet sender takes the ack (which
    rings no bell) of a request's last chunk within seconds: from that chunk until its ack
    its thread polls (`_ucx_replies`). A chunk before the last awaits nothing."""
    monkeypatch.setattr(ucx, "RUNG_SLEEP_S", 60.0)
    monkeypatch.setattr(_ucx_replies, "REPLY_WINDOW_S", 2.0)  # (a slow host's margin)
    a, b = UcxTransport(h.TOKEN, quiet_sleep_s=60.0), UcxTransport(h.TOKEN)
    try:
        _, _, writer = pull_pair(a, b, 1)
        a.send(b.address, {"n": 0}, [1])
        h.collect(b, 1, 5.0)
        b.send(a.address, {"n": 1})  # (b's link to a, welcomed; it rings a)
        h.collect(a, 1, 5.0)
        time.sleep(0.3)
        a.send(b.address, writer.plain_chunk("r-1", 0, 16, [2], [3]), [2])
        h.collect(b, 1, 5.0)
        with a._lock:
            assert not a._replies.pending(time.monotonic())
        last = writer.write(
            "r-1", 1, last=True, num_tokens=20, src_block_ids=[4], dst_block_ids=[5]
        )
        a.send(b.address, last, [4])
        (message,) = h.collect(b, 1, 5.0)
        assert message.header["manifest"]["last"] is True
        time.sleep(0.05)  # (a's thread is idle again: it would sleep for a minute)
        start = time.monotonic()
        b.send(a.address, {"type": "ack", "request_id": "r-1", "chunk_index": 1})
        (ack,) = h.collect(a, 1, 5.0)
        assert ack.header["type"] == "ack" and time.monotonic() - start < 5.0
        with a._lock:
            assert not a._replies.pending(time.monotonic())  # (answered: it polls no more)
    finally:
        a.close()
        b.close()
