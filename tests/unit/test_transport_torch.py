"""The torch.distributed (gloo) transport between two processes (see tests/transport_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from tests import transport_deaths as deaths
from tests import transport_harness as h

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def peer() -> Iterator[h.PeerProcess]:
    process = h.PeerProcess()
    yield process
    process.stop()


def test_pages_land_at_the_right_blocks(peer: h.PeerProcess) -> None:
    got = h.check_pages_land("torch", peer)
    direct = [r.header["request_id"] for r in got if r.header["direct"]]
    assert direct == ["r0", "r2"]  # one consecutive dst run: received straight into the pool


def test_fifo(peer: h.PeerProcess) -> None:
    h.check_fifo("torch", peer)


def test_wrong_token_is_refused(peer: h.PeerProcess) -> None:
    h.check_wrong_token("torch", peer)


def test_cancel_drops_queued_sends(peer: h.PeerProcess) -> None:
    h.check_cancel("torch", peer)


def test_sender_sees_peer_death() -> None:
    deaths.check_peer_death("torch")


def test_a_killed_senders_process_is_reported_gone_after_its_messages() -> None:
    deaths.check_sender_death_reported("torch")  # (over TCP: the hello names the pid)


def test_a_sender_that_closes_its_endpoint_and_lives_is_not_reported_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deaths.check_closed_sender_not_reported_gone("torch", monkeypatch)


def test_close_is_idempotent(peer: h.PeerProcess) -> None:
    h.check_close("torch", peer)


def test_backend_is_nccl_only_with_a_cuda_pool_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handshake offers NCCL (`hello["cuda"]`, with the GPU's UUID) only when this side's
    pool is on CUDA and torch has NCCL; pages are then received on the pool's device, else
    through host memory. Two pools on the same GPU use gloo: NCCL refuses two ranks on one GPU."""
    from types import SimpleNamespace

    import torch

    from tandem.kernels.kv_cache import KVCachePool
    from tandem.kv_transfer.torch_dist import TorchDistTransport

    transport = TorchDistTransport("token")
    try:
        assert transport._hello_extra() == {"cuda": False, "gpu": None}  # no pool yet
        transport.register_pool(KVCachePool(4, 1, 4, 1, 8))
        assert transport._hello_extra() == {"cuda": False, "gpu": None}  # a CPU pool: gloo
        transport._pool = SimpleNamespace(device=torch.device("cuda", 0))  # type: ignore[assignment]
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-a")
        )
        assert transport._hello_extra() == {"cuda": True, "gpu": "GPU-a"}
        assert transport._recv_device("nccl") == torch.device("cuda", 0)
        assert transport._recv_device("gloo") == torch.device("cpu")
        chosen = [
            transport._accept_hello(SimpleNamespace(state=None), hello)["backend"]  # type: ignore[arg-type]
            for hello in (
                {"cuda": True, "gpu": "GPU-b"},
                {"cuda": True, "gpu": "GPU-a"},
                {"cuda": False, "gpu": None},
            )
        ]
        assert chosen == ["nccl", "gloo", "gloo"]
        monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
        assert transport._hello_extra() == {"cuda": False, "gpu": None}
    finally:
        transport._pool = None
        transport.close()


def test_a_workers_transport_listens_on_its_nodes_address(tiny_checkpoint: Any) -> None:
    """A peer on another node or pod dials the address a transport advertises: a worker's
    torch transport takes its node's (loopback, the class's default, reaches nobody there),
    unless the config's `transport_options` say where."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.worker_settings import WorkerSettings, create_engine_and_transport

    engine = EngineConfig(model=str(tiny_checkpoint()), num_kv_blocks=8)
    for options, want in (({}, "127.0.0.2"), ({"host": "127.0.0.1"}, "127.0.0.1")):
        settings = WorkerSettings(role="decode", engine=engine, auth_token="t",
                                  transport="torch", transport_options=options)  # fmt: skip
        _, transport = create_engine_and_transport(settings, node_ip="127.0.0.2")
        try:
            assert transport.address.rsplit(":", 1)[0] == f"torch:{want}"
        finally:
            transport.close()
