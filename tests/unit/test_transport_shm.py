"""The shared-memory transport between two processes (see tests/transport_harness.py)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer import _chunk_records, _cross_memory, _pull_ring
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter, TransferError
from tandem.kv_transfer.registry import create_transport
from tandem.kv_transfer.shm import ShmTransport
from tests import transport_harness as h

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shm")

REGION = {"cross_memory": False}
"""Options for receiving pools in shared-memory regions (the sender maps them)."""
PRIVATE = {"cross_memory": True}
"""... in private huge-page memory written by cross-memory attach (where the kernel allows)."""
needs_cross_memory = pytest.mark.skipif(
    not _cross_memory.available(), reason="cross-memory attach not allowed here"
)
PULL = {"pull": True}
"""... or read by the receiver from the sender's pool, announced in a ring (`_shm_pull`)."""
needs_pull = pytest.mark.skipif(
    not (_cross_memory.available() and _pull_ring.supported()), reason="no pull path here"
)
LAYOUT = KVLayout(
    namespace="ns", block_size=16, num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32"
)
"""The layout of the test pool, for chunk headers."""
COMPACT = {"request_id": "x", "chunk_index": 0, "num_tokens": 16, "dst_block_ids": [2]}
"""A plain chunk's manifest fields, for compact ring records."""
POOL_KINDS = [
    pytest.param(REGION, id="region"),
    pytest.param(PRIVATE, id="private", marks=needs_cross_memory),
    pytest.param(PULL, id="pull", marks=needs_pull),
]


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
        yield sender, receiver, pool, target
    finally:
        sender.close()
        receiver.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[h.PeerProcess]:
    process = h.PeerProcess()
    yield process
    process.stop()


@pytest.mark.parametrize("options", POOL_KINDS)
def test_pages_land_directly_in_the_receivers_pool(
    peer: h.PeerProcess, options: dict[str, Any]
) -> None:
    got = h.check_pages_land("shm", peer, shm_pool=True, options=options)
    assert all(r.header["direct"] is True and r.staged_blocks == 0 for r in got[:-1])


@needs_cross_memory
def test_a_refused_cross_memory_write_stages_instead(
    peer: h.PeerProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the kernel refuses to write into the receiver (a stricter ptrace policy than this
    process saw), found when the link opens, the link stages its pages: they still land
    byte-exact."""
    monkeypatch.setattr(_cross_memory, "allowed", lambda pid, address: False)
    got = h.check_pages_land("shm", peer, shm_pool=True, options=PRIVATE)
    assert all(r.header["direct"] is False and r.staged_blocks > 0 for r in got)
    assert "cannot write into the pool of" in caplog.text


@needs_cross_memory
def test_a_failed_cross_memory_write_fails_the_batch_not_silently(
    peer: h.PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails after the link opened reports a transport error for the requests it
    carried; the receiver gets no header announcing pages that are not there."""
    address, _ = peer.create("shm", shm_pool=True, options=PRIVATE)
    sender, _ = h.make_endpoint("shm", options=PRIVATE)
    try:
        sender.send(address, h.manifest_header("ok", [1]), [1])
        assert [r.header["request_id"] for r in peer.receive(1)] == ["ok"]

        def fail(pid: int, runs: Any) -> None:
            raise OSError(14, "process_vm_writev copied 0 of 65536 bytes")

        monkeypatch.setattr(_cross_memory, "write", fail)
        sender.send(address, h.manifest_header("bad", [2]), [2])
        errors = [m.header for m in h.collect(sender, 1, 10.0)]
        assert [(e["type"], e["request_id"]) for e in errors] == [("transport_error", "bad")]
        assert "could not write pages" in errors[0]["error"]
        assert peer.receive(1, timeout=0.5) == []
    finally:
        sender.close()


def test_pages_are_staged_for_a_plain_pool(peer: h.PeerProcess) -> None:
    got = h.check_pages_land("shm", peer, shm_pool=False)
    assert all(r.header["direct"] is False and r.staged_blocks > 0 for r in got)


@pytest.mark.parametrize("options", POOL_KINDS)
def test_fifo(peer: h.PeerProcess, options: dict[str, Any]) -> None:
    h.check_fifo("shm", peer, shm_pool=True, options=options)


def test_wrong_token_is_refused(peer: h.PeerProcess) -> None:
    h.check_wrong_token("shm", peer, shm_pool=True)


@pytest.mark.parametrize("options", POOL_KINDS)
def test_cancel_drops_queued_sends(peer: h.PeerProcess, options: dict[str, Any]) -> None:
    h.check_cancel("shm", peer, shm_pool=True, options=options)


def test_sender_sees_peer_death() -> None:
    h.check_peer_death("shm")


@pytest.mark.parametrize("options", POOL_KINDS)
def test_close_is_idempotent_and_unlinks_regions(
    peer: h.PeerProcess, options: dict[str, Any]
) -> None:
    ids = h.check_close("shm", peer, shm_pool=True, options=options)
    assert len(ids) == 2
    for endpoint_id in ids:
        assert h.shm_entries(endpoint_id) == []


def test_staging_ring_wraps_and_grows() -> None:
    """Messages larger than the ring grow it; many messages wrap it; all pages stay exact."""
    a = create_transport("shm", h.TOKEN, staging_bytes=200_000)
    b = create_transport("shm", h.TOKEN)
    try:
        src_pool = KVCachePool(**h.POOL)
        h.fill_pool(src_pool, 5)
        a.register_pool(src_pool)
        sends = [[i % 48] for i in range(12)] + [list(range(8))] + [[7, 3], [1]]
        for n, src in enumerate(sends):
            a.send(b.address, {"n": n}, src)
        got = h.collect(b, len(sends), 10.0)
        assert [m.header["n"] for m in got] == list(range(len(sends)))
        for m, src in zip(got, sends, strict=True):
            assert m.pages is not None and torch.equal(m.pages, src_pool.export_blocks(src))
    finally:
        a.close()
        b.close()
    assert isinstance(a, ShmTransport)
    assert h.shm_entries(a.endpoint_id) == [] and not os.path.exists(a.address[4:])


@pytest.mark.parametrize("options", POOL_KINDS[:2])
def test_allocate_pool_is_a_working_kv_pool(options: dict[str, Any]) -> None:
    t = ShmTransport(h.TOKEN, **options)
    private = t.cross_memory
    assert private == options["cross_memory"]
    try:
        pool = t.allocate_pool(4, 2, 8, 2, 16, dtype=torch.bfloat16)
        assert pool.tensor.is_contiguous() and pool.tensor.dtype == torch.bfloat16
        assert int(pool.tensor.count_nonzero()) == 0
        data = torch.randn(pool.blocks_shape(2)).to(torch.bfloat16)
        pool.import_blocks([3, 1], data)
        assert torch.equal(pool.export_blocks([3, 1]), data)
        assert len(h.shm_entries(t.endpoint_id)) == (0 if private else 1)
        if private:  # on transparent huge pages
            assert pool.tensor.data_ptr() % (2 << 20) == 0
    finally:
        t.close()
    assert h.shm_entries(t.endpoint_id) == []
    assert torch.equal(pool.export_blocks([3, 1]), data)  # still mapped after unlink


def test_pool_wraps_only_a_matching_tensor() -> None:
    good = torch.zeros(KVCachePool(2, 1, 4, 1, 8).blocks_shape(2))
    assert KVCachePool(2, 1, 4, 1, 8, tensor=good).tensor is good
    with pytest.raises(ValueError):
        KVCachePool(3, 1, 4, 1, 8, tensor=good)
    with pytest.raises(ValueError):
        KVCachePool(2, 1, 4, 1, 8, dtype=torch.float16, tensor=good)
    with pytest.raises(ValueError):
        KVCachePool(2, 1, 4, 1, 8, tensor=torch.zeros(4, *good.shape[1:])[::2])


def test_a_send_only_pool_is_private_memory_on_huge_page_boundaries() -> None:
    """A prefill worker's pool (pages only go out) is not in shared memory: it sits on 2 MiB
    boundaries for transparent huge pages; pages still land directly in a shared pool."""
    sender = create_transport("shm", h.TOKEN)
    receiver = create_transport("shm", h.TOKEN, **REGION)
    assert isinstance(sender, ShmTransport) and isinstance(receiver, ShmTransport)
    try:
        pool = sender.allocate_pool(**h.POOL, send_only=True)
        assert pool.tensor.data_ptr() % (2 << 20) == 0
        assert h.shm_entries(sender.endpoint_id) == []
        h.fill_pool(pool, 3)
        sender.register_pool(pool)
        target = receiver.allocate_pool(**h.POOL)
        assert len(h.shm_entries(receiver.endpoint_id)) == 1
        receiver.register_pool(target)
        sender.send(receiver.address, h.manifest_header("s", [7, 8]), [1, 2])
        (got,) = h.collect(receiver, 1, 10.0)
        assert got.header["direct"] is True
        assert h.block_digests(target)[7:9] == h.block_digests(pool)[1:3]
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(("role", "shared"), [("prefill", 0), ("decode", 1)])
def test_workers_keep_only_the_decode_pool_in_shared_memory(
    tiny_checkpoint: Any, role: str, shared: int
) -> None:
    """Only a decode worker's pool receives pages: in a shared region, or in private memory
    that senders write by cross-memory attach where the kernel allows it."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.worker_settings import WorkerSettings, create_engine_and_transport

    settings = WorkerSettings(
        role=role,  # type: ignore[arg-type]
        engine=EngineConfig(model=str(tiny_checkpoint()), num_kv_blocks=16),
        auth_token="t",
    )
    engine, transport = create_engine_and_transport(settings)
    assert isinstance(transport, ShmTransport)
    if transport.cross_memory:
        shared = 0
    try:
        assert len(h.shm_entries(transport.endpoint_id)) == shared
        assert engine.kv_pool.num_blocks == 16
    finally:
        transport.close()


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
