"""The shm transport's pull path between two endpoints: the receiver copies pages out of the
sender's pool (`_shm_pull`), from a ring of records (JSON, or compact chunk records)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _chunk_records
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter, TransferError
from tandem.kv_transfer.registry import create_transport
from tandem.kv_transfer.shm import ShmTransport
from tests import transport_harness as h
from tests.unit.test_transport_shm import needs_pull, pytestmark  # noqa: F401

LAYOUT = KVLayout(
    namespace="ns", block_size=16, num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32"
)
"""The layout of the test pool, for chunk headers."""
COMPACT = {"request_id": "x", "chunk_index": 0, "num_tokens": 16, "dst_block_ids": [2]}
"""A plain chunk's manifest fields, for compact ring records."""


@contextlib.contextmanager
def pull_link() -> Iterator[tuple[ShmTransport, ShmTransport, KVCachePool, KVCachePool]]:
    """A sender with a send-only pool and a receiver, the pull link between them open (one
    message went through); yields (sender, receiver, the sender's pool, the receiver's)."""
    sender = create_transport("shm", h.TOKEN)
    receiver = create_transport("shm", h.TOKEN)
    assert isinstance(sender, ShmTransport) and isinstance(receiver, ShmTransport)
    try:
        pool = sender.allocate_pool(**h.POOL, send_only=True)
        h.fill_pool(pool, 5)
        sender.register_pool(pool)
        target = receiver.allocate_pool(**h.POOL)
        receiver.register_pool(target)
        sender.send(receiver.address, {"request_id": "first"})
        assert len(h.collect(receiver, 1, 10.0)) == 1
        assert sender._links[receiver.address].state.pull is not None
        # The sender's thread may still be finishing that first message (the peer counts as
        # busy until it has): only then do sends go straight to the ring.
        deadline = time.monotonic() + 5.0
        while sender._busy_peer == receiver.address or sender._queues.get(receiver.address):
            assert time.monotonic() < deadline, "the sender thread stayed busy"
            time.sleep(0.001)
        yield sender, receiver, pool, target
    finally:
        sender.close()
        receiver.close()


@needs_pull
def test_the_pull_path_is_taken_and_a_sleeping_reader_is_woken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send-only pool offers its ring; records reach a reader that went to sleep through the
    link's wake frame (its own periodic look is set far beyond the wait here)."""
    from tandem.kv_transfer import _shm_pull

    monkeypatch.setattr(_shm_pull, "IDLE_CHECK_S", 30.0)
    with pull_link() as (sender, receiver, pool, target):
        sender.send(receiver.address, h.manifest_header("a", [4, 5]), [10, 11])
        (first,) = h.collect(receiver, 1, 10.0)
        assert first.header["direct"] is True and first.pages is None
        assert [n for n in h.shm_entries(sender.endpoint_id) if n.endswith("-r0")]
        for n, (src, dst) in enumerate([([3], [9]), ([20, 21, 22], [30, 31, 40])]):
            time.sleep(0.3)  # the reader is asleep by now
            start = time.monotonic()
            sender.send(receiver.address, h.manifest_header(f"b{n}", dst), src)
            (got,) = h.collect(receiver, 1, 5.0)
            assert got.header["request_id"] == f"b{n}" and time.monotonic() - start < 1.0
        digests, sent = h.block_digests(target), h.block_digests(pool)
        for src, dst in [([10, 11], [4, 5]), ([3], [9]), ([20, 21, 22], [30, 31, 40])]:
            assert [digests[d] for d in dst] == [sent[s] for s in src]
    assert h.shm_entries(sender.endpoint_id) == []


@needs_pull
def test_a_stream_is_polled_and_costs_the_sender_one_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a stream's chunks keep coming the reader polls, so only its first chunk makes the
    sender write a wake frame. A message that is not a plain chunk (the last chunk, which
    commits the request; anything after) always comes with one: it must not wait for a look."""
    from tandem.kv_transfer import _shm_pull

    wakes: list[str] = []
    real_send_frame = _shm_pull.send_frame

    def counting(sock: Any, payload: Any) -> None:
        wakes.append(str(payload))
        real_send_frame(sock, payload)

    monkeypatch.setattr(_shm_pull, "send_frame", counting)
    monkeypatch.setattr(_shm_pull, "IDLE_CHECK_S", 30.0)  # (no periodic look: only wakes)
    writer = PagesHeaderWriter(LAYOUT)
    with pull_link() as (sender, receiver, _, _):
        time.sleep(0.1)  # the reader has nothing under way: asleep
        before = len(wakes)
        for chunk in range(4):
            last = chunk == 3
            header = writer.write(
                "s",
                chunk,
                last=last,
                num_tokens=16 * (chunk + 1),
                src_block_ids=[chunk],
                dst_block_ids=[chunk],
                first_token_ids=[1] if last else (),
            )
            start = time.monotonic()
            sender.send(receiver.address, header, [chunk])
            assert len(h.collect(receiver, 1, 5.0)) == 1
            assert time.monotonic() - start < 0.5
            time.sleep(0.02)
            assert len(wakes) == before + (1 if chunk < 3 else 2), chunk
        time.sleep(0.1)
        sender.send(receiver.address, {"type": "after"})
        assert len(h.collect(receiver, 1, 5.0)) == 1
        assert len(wakes) == before + 3


@needs_pull
def test_plain_chunks_travel_as_compact_records() -> None:
    """A stream's chunks from `PagesHeaderWriter` go as compact records (the layout announced
    once per link), so the sender never writes their JSON text; the receiver gets the header
    that text would have said, and the pages byte-exact. The last chunk goes as JSON."""
    writer = PagesHeaderWriter(LAYOUT)
    chunks = [([10, 11], [4, 5], False), ([3], [9], False), ([20, 21, 22], [30, 31, 40], True)]
    with pull_link() as (sender, receiver, pool, target):
        pull = sender._links[receiver.address].state.pull
        sent = []
        for index, (src, dst, last) in enumerate(chunks):
            header = writer.write(
                "r\u00e9q",
                index,
                last=last,
                num_tokens=16 * (index + 1),
                src_block_ids=src,
                dst_block_ids=dst,
                first_token_ids=[7] if last else (),
            )
            sender.send(receiver.address, header, src)
            sent.append(header)
        got = h.collect(receiver, 3, 10.0)
        assert [header._text is None for header in sent] == [True, True, False]
        for message, header in zip(got, sent, strict=True):
            assert message.header == {**json.loads(header.text), "direct": True}
        assert list(pull._layouts.values()) == [0]  # one layout record, announced once
        digests, source = h.block_digests(target), h.block_digests(pool)
        for src, dst, _ in chunks:
            assert [digests[d] for d in dst] == [source[s] for s in src]


@needs_pull
@pytest.mark.parametrize(
    "record",
    [
        b"not json",
        b'{"src":[1],"header":3}',
        b'{"src":[999],"header":{"request_id":"x"}}',
        b"C\x00\x01",
        _chunk_records.chunk_record(7, COMPACT, (1,)),
        _chunk_records.layout_record("{}") + b"\xff",
    ],
    ids=[
        "not-json",
        "no-header",
        "block-outside-the-pool",
        "short-chunk",
        "unannounced-layout",
        "bad-layout",
    ],
)
def test_a_bad_ring_record_ends_the_connection(record: bytes) -> None:
    """The receiver trusts nothing in the ring: a record it cannot read, or one naming blocks
    outside the sender's pool, ends the connection (the sender hears of it), never a copy."""
    with pull_link() as (sender, receiver, _, target):
        before = h.block_digests(target)
        pull = sender._links[receiver.address].state.pull
        assert pull is not None and pull.ring.write(record)
        sender.send(receiver.address, {"request_id": "wake"})  # (wakes the reader if asleep)
        errors = [m.header for m in h.collect(sender, 1, 10.0)]
        assert errors and errors[0]["type"] == "transport_error"
        # ("wake" itself may arrive, over a new link, if the reader failed before it was sent)
        later = h.collect(receiver, 1, 0.3)
        assert [m.header["request_id"] for m in later] in ([], ["wake"])
        assert h.block_digests(target) == before


@needs_pull
def test_a_header_larger_than_the_pull_ring_is_refused_at_send() -> None:
    with pull_link() as (sender, receiver, _, _):
        with pytest.raises(TransferError, match="exceeds the pull ring"):
            sender.send(receiver.address, {"request_id": "big", "blob": "x" * (2 << 20)})
        sender.send(receiver.address, {"request_id": "after"}, [1])
        (got,) = h.collect(receiver, 1, 10.0)
        assert got.header["request_id"] == "after"


@needs_pull
def test_a_receiver_gone_is_reported_by_poll_not_raised_by_send() -> None:
    """`send` never raises for a broken link (a prefill engine's thread calls it): a receiver
    that went away is reported through the sender's `poll`."""
    with pull_link() as (sender, receiver, _, _):
        time.sleep(0.1)  # the reader is asleep: the next record needs a wake frame
        receiver.close()
        for n in range(5):  # the socket may still look open for the first of these
            sender.send(receiver.address, {"request_id": f"late{n}"}, [n])
            time.sleep(0.05)
        errors = [m.header for m in h.collect(sender, 1, 10.0)]
        assert errors and errors[0]["type"] == "transport_error"


def _reader(receiver: ShmTransport) -> Any:
    """The receiver's pull reader (its one connection's)."""
    (conn,) = list(receiver._conns)
    assert conn.state.reader is not None
    return conn.state.reader


def _backlog(
    monkeypatch: pytest.MonkeyPatch,
    reads: list[tuple[str, int]],
    fail_at: int | None = None,
    copy_threads: int = 1,
) -> None:
    """Groups of two blocks' pages read by `copy_threads`; every page read recorded as (thread
    name, run count), the read number `fail_at` (0-based) failing."""
    import threading

    from tandem.kv_transfer import _shm_pull

    real_read = _shm_pull._cross_memory.read

    def recording(pid: int, runs: Any) -> None:
        reads.append((threading.current_thread().name, len(runs)))
        if len(reads) - 1 == fail_at:
            raise OSError("read failed (test)")
        real_read(pid, runs)

    monkeypatch.setattr(_shm_pull._cross_memory, "read", recording)
    bytes_per_block = 2 * 16 * 4 * 64 * 2 * 4  # (h.POOL, float32)
    monkeypatch.setattr(_shm_pull, "GROUP_BYTES", 2 * bytes_per_block)
    monkeypatch.setattr(_shm_pull, "COPY_THREADS", copy_threads)


MOVES = [([2 * n, 2 * n + 1], [40 - 2 * n, 41 - 2 * n]) for n in range(8)] + [([30, 17], [5, 3])]
"""Source and destination blocks of a backlog's messages (runs and scattered ids)."""


def _send_moves_at_once(sender: ShmTransport, receiver: ShmTransport) -> None:
    """`MOVES` into the ring while its reader cannot look: one look finds them all."""
    with _reader(receiver)._lock:
        for n, (src, dst) in enumerate(MOVES):
            sender.send(receiver.address, h.manifest_header(f"m{n}", dst), src)


@needs_pull
def test_a_backlog_is_read_a_group_at_a_time_and_delivered_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages that a look finds together are read in groups of `GROUP_BYTES` on the copy
    thread while the reader parses the next; they arrive in ring order, pages byte-exact. A
    look that finds one message reads it on the reader's own thread."""
    reads: list[tuple[str, int]] = []
    _backlog(monkeypatch, reads)
    with pull_link() as (sender, receiver, pool, target):
        _send_moves_at_once(sender, receiver)
        got = h.collect(receiver, len(MOVES), 10.0)
        assert [m.header["request_id"] for m in got] == [f"m{n}" for n in range(len(MOVES))]
        assert all(m.header["direct"] is True and m.pages is None for m in got)
        digests, source = h.block_digests(target), h.block_digests(pool)
        for src, dst in MOVES:
            assert [digests[d] for d in dst] == [source[s] for s in src]
        # 9 messages of two blocks: 8 groups of one run each, the scattered one (two runs) last
        assert [count for _, count in reads] == [1] * 8 + [2]
        assert {name.split("_")[0] for name, _ in reads} == {"tandem-kv-pull-copy"}
        del reads[:]
        sender.send(receiver.address, h.manifest_header("alone", [7]), [8])
        (alone,) = h.collect(receiver, 1, 10.0)
        assert alone.header["request_id"] == "alone" and len(reads) == 1
        assert not reads[0][0].startswith("tandem-kv-pull-copy")
        assert h.block_digests(target)[7] == source[8]
    time.sleep(0.2)
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("tandem-kv-pull-copy")]


@needs_pull
def test_copy_threads_read_a_share_of_each_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two copy threads each group is read in two shares (here a block each), on those
    threads; the pages land byte-exact and the messages arrive in ring order."""
    reads: list[tuple[str, int]] = []
    _backlog(monkeypatch, reads, copy_threads=2)
    with pull_link() as (sender, receiver, pool, target):
        _send_moves_at_once(sender, receiver)
        got = h.collect(receiver, len(MOVES), 10.0)
        assert [m.header["request_id"] for m in got] == [f"m{n}" for n in range(len(MOVES))]
        digests, source = h.block_digests(target), h.block_digests(pool)
        for src, dst in MOVES:
            assert [digests[d] for d in dst] == [source[s] for s in src]
        assert sorted(count for _, count in reads) == [1] * 18
        assert len({name for name, _ in reads}) == 2
        assert all(name.startswith("tandem-kv-pull-copy") for name, _ in reads)


def test_split_runs_cuts_copies_into_equal_shares_in_order() -> None:
    from tandem.kv_transfer._cross_memory import split_runs

    assert split_runs([(0, 1000, 8192)], 2) == [[(0, 1000, 4096)], [(4096, 5096, 4096)]]
    three = [(0, 0, 4096), (10_000, 20_000, 12_288), (50_000, 60_000, 4096)]
    assert split_runs(three, 2) == [
        [(0, 0, 4096), (10_000, 20_000, 8192)],
        [(18_192, 28_192, 4096), (50_000, 60_000, 4096)],
    ]
    assert split_runs(three, 1) == [three]
    assert split_runs([(0, 0, 100)], 2) == [[(0, 0, 100)]]  # (cut at 4 KiB multiples only)
    assert split_runs([(0, 0, 6000)], 2, align=1) == [[(0, 0, 3000)], [(3000, 3000, 3000)]]
    assert split_runs([], 2) == []
    for parts in (1, 2, 3, 5):
        out = split_runs(three, parts, align=8)
        assert len(out) <= parts
        flat = [run for part in out for run in part]
        assert sum(n for *_, n in flat) == 20_480
        assert flat[0][:2] == (0, 0) and flat[-1][0] + flat[-1][2] == 54_096


@needs_pull
def test_a_failed_group_read_delivers_none_of_that_group_and_ends_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The groups read before a failed read arrive; the failed one and those after it do not
    (their pages may be partial), and the sender hears that the link broke."""
    reads: list[tuple[str, int]] = []
    _backlog(monkeypatch, reads, fail_at=3)
    with pull_link() as (sender, receiver, _, _):
        _send_moves_at_once(sender, receiver)
        got = [m.header["request_id"] for m in h.collect(receiver, len(MOVES), 2.0)]
        assert got == ["m0", "m1", "m2"]
        errors = [m.header for m in h.collect(sender, 1, 10.0)]
        assert errors and errors[0]["type"] == "transport_error"
