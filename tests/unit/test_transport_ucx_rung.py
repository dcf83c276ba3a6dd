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

from tandem.kv_transfer import ucx  # noqa: E402
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter  # noqa: E402
from tandem.kv_transfer.ucx import UcxTransport  # noqa: E402
from tests import transport_harness as h  # noqa: E402


def records_taken(receiver: UcxTransport) -> list[int]:
    """The first byte of each compact record `receiver` takes, in order (a spy)."""
    seen: list[int] = []
    take = receiver._on_record

    def spy(conn_id: int, conn: Any, raw: bytes) -> None:
        seen.append(raw[0])
        take(conn_id, conn, raw)

    receiver._on_record = spy  # type: ignore[method-assign]
    return seen


def test_plain_chunks_go_as_compact_records_and_arrive_as_their_json_says() -> None:
    a, b = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN)
    seen = records_taken(b)
    try:
        a_pool, b_pool = a.allocate_pool(**h.POOL, send_only=True), b.allocate_pool(**h.POOL)
        h.fill_pool(a_pool, 3)
        a.register_pool(a_pool)
        b.register_pool(b_pool)
        writer = PagesHeaderWriter(KVLayout.of_pool(a_pool, "ns-1"))

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
    """With the bell's sleep at 60 s, a frame is taken within seconds only because its
    sender rang; a sender that pushes (it does not ring) puts the receiver back to polling."""
    monkeypatch.setattr(ucx, "RUNG_SLEEP_S", 60.0)
    a, b, pushing = UcxTransport(h.TOKEN), UcxTransport(h.TOKEN), UcxTransport(h.TOKEN, pull=False)
    try:
        for transport in (a, b, pushing):
            pool = transport.allocate_pool(**h.POOL)
            h.fill_pool(pool, 1)
            transport.register_pool(pool)
        a.send(b.address, {"n": 0}, [1])
        h.collect(b, 1, 5.0)
        deadline = time.monotonic() + 5.0
        while not b._rung_only() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b._rung_only()
        for n in (1, 2, 3):
            time.sleep(0.2)  # (b's thread is asleep on its bell by now)
            start = time.monotonic()
            a.send(b.address, {"n": n}, [n])
            (message,) = h.collect(b, 1, 30.0)
            assert message.header["n"] == n and time.monotonic() - start < 10.0
        pushing.send(b.address, {"n": 4}, [2])
        (message,) = h.collect(b, 1, 30.0)
        assert message.header["n"] == 4 and not b._rung_only()
    finally:
        for transport in (a, b, pushing):
            transport.close()
