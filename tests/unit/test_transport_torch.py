"""The torch.distributed (gloo) transport between two processes (see tests/transport_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

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
    h.check_peer_death("torch")


def test_close_is_idempotent(peer: h.PeerProcess) -> None:
    h.check_close("torch", peer)
