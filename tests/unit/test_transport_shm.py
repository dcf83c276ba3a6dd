"""The shared-memory transport between two processes (see tests/transport_harness.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer.registry import create_transport
from tandem.kv_transfer.shm import ShmTransport
from tests import transport_harness as h

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shm")


@pytest.fixture(scope="module")
def peer() -> Iterator[h.PeerProcess]:
    process = h.PeerProcess()
    yield process
    process.stop()


def test_pages_land_directly_in_a_shared_pool(peer: h.PeerProcess) -> None:
    got = h.check_pages_land("shm", peer, shm_pool=True)
    assert all(r.header["direct"] is True and r.staged_blocks == 0 for r in got[:-1])


def test_pages_are_staged_for_a_plain_pool(peer: h.PeerProcess) -> None:
    got = h.check_pages_land("shm", peer, shm_pool=False)
    assert all(r.header["direct"] is False and r.staged_blocks > 0 for r in got)


def test_fifo(peer: h.PeerProcess) -> None:
    h.check_fifo("shm", peer, shm_pool=True)


def test_wrong_token_is_refused(peer: h.PeerProcess) -> None:
    h.check_wrong_token("shm", peer, shm_pool=True)


def test_cancel_drops_queued_sends(peer: h.PeerProcess) -> None:
    h.check_cancel("shm", peer, shm_pool=True)


def test_sender_sees_peer_death() -> None:
    h.check_peer_death("shm")


def test_close_is_idempotent_and_unlinks_regions(peer: h.PeerProcess) -> None:
    ids = h.check_close("shm", peer, shm_pool=True)
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


def test_allocate_pool_is_a_working_kv_pool() -> None:
    t = ShmTransport(h.TOKEN)
    try:
        pool = t.allocate_pool(4, 2, 8, 2, 16, dtype=torch.bfloat16)
        assert pool.tensor.is_contiguous() and pool.tensor.dtype == torch.bfloat16
        assert int(pool.tensor.count_nonzero()) == 0
        data = torch.randn(pool.blocks_shape(2)).to(torch.bfloat16)
        pool.import_blocks([3, 1], data)
        assert torch.equal(pool.export_blocks([3, 1]), data)
        assert len(h.shm_entries(t.endpoint_id)) == 1
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
    receiver = create_transport("shm", h.TOKEN)
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
    from tandem.engine.config import EngineConfig
    from tandem.engine.worker_settings import WorkerSettings, create_engine_and_transport

    settings = WorkerSettings(
        role=role,  # type: ignore[arg-type]
        engine=EngineConfig(model=str(tiny_checkpoint()), num_kv_blocks=16),
        auth_token="t",
    )
    engine, transport = create_engine_and_transport(settings)
    try:
        assert len(h.shm_entries(transport.endpoint_id)) == shared
        assert engine.kv_pool.num_blocks == 16
    finally:
        transport.close()
