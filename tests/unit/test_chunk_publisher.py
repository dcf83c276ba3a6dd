"""`ChunkPublisher`: a prefill's chunks leave from a thread of their own, in order; `flush` and
`drop` on the engine's thread see a chunk being sent through; failures come back."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import pytest

from tandem.kv_transfer import chunk_publisher
from tandem.kv_transfer.chunk_publisher import ChunkPublisher
from tandem.kv_transfer.manifest import TransferError


class Recorder:
    """Stands for a transport: records (request id, chunk index, sending thread)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.refuse: set[str] = set()

    def send(self, peer: str, header: dict[str, Any], src_block_ids: Any = ()) -> None:
        self.gate.wait(10.0)
        if header["request_id"] in self.refuse:
            raise TransferError("peer gone")
        self.sent.append((header["request_id"], header["chunk"], threading.current_thread().name))


class QueuedChunk(NamedTuple):
    """What the tests queue: where it goes, its request, its index and blocks."""

    peer: str
    request_id: str
    chunk_index: int
    src_block_ids: list[int]


def chunk(rid: str, index: int) -> QueuedChunk:
    return QueuedChunk("fake:d", rid, index, [index])


def prepare(c: QueuedChunk) -> tuple[str, dict[str, Any], list[int]]:
    return c.peer, {"request_id": c.request_id, "chunk": c.chunk_index}, c.src_block_ids


def publisher_for(transport: Recorder) -> ChunkPublisher:
    return ChunkPublisher(transport, prepare)  # type: ignore[arg-type]


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_chunks_leave_in_order_from_the_publishing_thread() -> None:
    transport = Recorder()
    publisher = publisher_for(transport)
    try:
        for index in range(5):
            publisher.add("a", chunk("a", index))
            time.sleep(0.01)
        wait_for(lambda: len(transport.sent) == 5)
        assert [(rid, i) for rid, i, _ in transport.sent] == [("a", i) for i in range(5)]
        assert {thread for _, _, thread in transport.sent} == {"kv-chunk-publisher"}
    finally:
        publisher.close()


def test_flush_and_drop_act_on_the_calling_thread() -> None:
    """With the thread stopped (so nothing races them): `drop` forgets one request's queued
    chunks, `flush` sends the rest, in order, on the calling thread."""
    transport = Recorder()
    publisher = publisher_for(transport)
    publisher.close()
    for c in (chunk("a", 0), chunk("b", 0), chunk("a", 1), chunk("b", 1)):
        publisher.add(c.request_id, c)
    assert [(c.request_id, c.chunk_index) for c in publisher.drop("a")] == [("a", 0), ("a", 1)]
    publisher.flush()
    assert transport.sent == [("b", 0, "MainThread"), ("b", 1, "MainThread")]


def test_flush_and_drop_wait_for_the_chunk_being_sent() -> None:
    """The thread is stuck sending a0: `drop` returns only once that send is done (the
    caller unpins after it), and forgets what is still queued of the request; `flush` then
    leaves every other chunk sent, each once, in order."""
    transport = Recorder()
    transport.gate.clear()
    publisher = publisher_for(transport)
    try:
        publisher.add("a", chunk("a", 0))
        wait_for(publisher._lock.locked)  # a0 is being sent
        publisher.add("a", chunk("a", 1))
        publisher.add("b", chunk("b", 0))
        publisher.add("b", chunk("b", 1))
        threading.Timer(0.1, transport.gate.set).start()
        dropped = publisher.drop("a")
        assert ("a", 0) in [(rid, i) for rid, i, _ in transport.sent]
        publisher.flush()
        sent = [(rid, i) for rid, i, _ in transport.sent]
        # (the thread may send a1 between a0 and the drop: locks are not fair)
        assert sent in ([("a", 0), ("b", 0), ("b", 1)], [("a", 0), ("a", 1), ("b", 0), ("b", 1)])
        assert len(dropped) == (1 if ("a", 1) not in sent else 0)
    finally:
        publisher.close()


def test_a_failed_send_is_reported_and_the_thread_goes_on() -> None:
    transport = Recorder()
    transport.refuse = {"bad"}
    publisher = publisher_for(transport)
    try:
        publisher.add("bad", chunk("bad", 0))
        publisher.add("good", chunk("good", 0))
        wait_for(lambda: len(transport.sent) == 1)
        assert publisher.failures() == [("bad", "could not send the pages: peer gone")]
        assert publisher.failures() == []
    finally:
        publisher.close()


def test_a_quiet_publisher_sleeps_and_the_next_chunk_wakes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chunk_publisher, "STREAM_GAP_S", 0.05)
    transport = Recorder()
    publisher = publisher_for(transport)
    try:
        publisher.add("a", chunk("a", 0))
        wait_for(lambda: publisher._asleep)
        start = time.monotonic()
        publisher.add("b", chunk("b", 0))
        wait_for(lambda: len(transport.sent) == 2)
        assert time.monotonic() - start < 1.0
    finally:
        publisher.close()
    assert not publisher._thread.is_alive()


def test_nothing_is_made_or_sent_inside_exclusive_and_flush_goes_first() -> None:
    """`exclusive()` keeps the thread from making or sending anything until it ends (the
    engine's thread reads what `prepare` writes); `exclusive(flush=True)` first sends what is
    queued, on the calling thread."""
    transport = Recorder()
    publisher = publisher_for(transport)
    try:
        with publisher.exclusive():
            publisher.add("a", chunk("a", 0))
            time.sleep(0.1)  # (the thread looks every few ms while a stream is under way)
            assert transport.sent == []
        wait_for(lambda: len(transport.sent) == 1)
        assert transport.sent[0][2] == "kv-chunk-publisher"
        with publisher.exclusive():  # held: what is added now waits for the flush below
            publisher.add("a", chunk("a", 1))
            publisher.add("b", chunk("b", 0))
        with publisher.exclusive(flush=True):
            sent_inside = [(rid, i) for rid, i, _ in transport.sent]
        assert sent_inside[:1] == [("a", 0)] and set(sent_inside) == {("a", 0), ("a", 1), ("b", 0)}
        assert [(rid, i) for rid, i, _ in transport.sent] == [("a", 0), ("a", 1), ("b", 0)]
    finally:
        publisher.close()
