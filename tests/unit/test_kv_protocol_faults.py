"""The transfer protocol over the in-process fake transport: duplicates, cancels from either
side, leases, a dying sender, timeouts, refused manifests and tokens; after each, both sides
hold nothing and the next request is exact."""

from __future__ import annotations

from typing import Any

import pytest

from tandem import LLM
from tandem.kv_transfer.base import Message
from tandem.kv_transfer.fake import FakeTransport
from tandem.kv_transfer.local import LocalHub
from tandem.kv_transfer.manifest import TransferError
from tandem.kv_transfer.sender import KVSender
from tests import kv_protocol_pair
from tests.kv_protocol_pair import (
    GREEDY,
    TOKEN,
    Pair,
    expect,
    next_request_is_exact,
    prompt_of,
)

model = kv_protocol_pair.model  # the module-scoped fixtures
colocated = kv_protocol_pair.colocated


def test_duplicate_chunk_is_acknowledged_and_ignored(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    pair.p_transport.duplicate(
        lambda h: h.get("type") == "pages" and h["manifest"]["chunk_index"] == 1
    )
    prompt = prompt_of(16 * 20, start=5)
    pair.start("d", prompt)
    events = pair.pump()
    assert "committed" in [e.kind for e in events]
    first = next(e.token_ids for e in events if e.kind == "first_token")
    assert list(first) + pair.decode_all()["d"] == expect(colocated, prompt)
    pair.idle()


def test_out_of_order_chunk_is_refused_and_everything_released(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    pair.p_transport.hold(lambda h: h.get("type") == "pages" and h["manifest"]["chunk_index"] == 1)
    pair.start("o", prompt_of(16 * 30, start=6))
    events = pair.pump(steps=3)
    pair.p_transport.release_held()
    events = pair.pump()
    failed = [e for e in events if e.kind == "failed"]
    assert failed and "out of order" in (failed[0].error or "")
    assert "committed" not in [e.kind for e in events]
    pair.idle()
    next_request_is_exact(pair, colocated)


def test_receiver_cancel_mid_stream_unpins_sender(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    pair.start("c", prompt_of(16 * 30, start=8))
    pair.events += pair.sender.step()
    pair.events += pair.receiver.poll()
    assert pair.receiver.cancel("c")
    events = pair.pump()
    assert ("cancelled", "c") in [(e.kind, e.request_id) for e in events]
    pair.idle()
    next_request_is_exact(pair, colocated)


def test_a_reservation_cancelled_before_its_first_pages_ends_as_a_cancel(
    model: str, colocated: LLM
) -> None:
    """Decode cancels (the client left) before any pages came, so it cannot tell the sender;
    the first pages then get a cancel back, not an error: the transfer ends "cancelled" on
    both sides and nothing counts as failed."""
    pair = Pair(model)
    prompt = prompt_of(16 * 20, start=12)
    grant = pair.receiver.reserve("early", prompt, GREEDY)
    assert pair.receiver.cancel("early", "client left")
    pair.sender.start("early", prompt, GREEDY, grant)
    events = pair.pump()
    assert [(e.kind, e.request_id, e.error) for e in events] == [
        ("cancelled", "early", "client left")
    ]
    assert pair.sender.num_transfers_failed == 0
    assert not pair.receiver.held and not pair.sender.outgoing
    pair.idle()
    next_request_is_exact(pair, colocated)


def test_sender_cancel_mid_stream_releases_reservation(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    pair.start("c", prompt_of(16 * 30, start=10))
    pair.events += pair.sender.step()
    assert pair.sender.cancel("c")
    events = pair.pump()
    kinds = [(e.kind, e.request_id) for e in events]
    assert ("cancelled", "c") in kinds
    assert not pair.receiver.reservations
    pair.idle()
    next_request_is_exact(pair, colocated)


def test_lease_expires_without_pages(model: str) -> None:
    pair = Pair(model)
    pair.receiver.reserve("l", prompt_of(40), GREEDY)
    assert pair.decode.block_manager.num_free_blocks < 256
    pair.clock.now += 6
    events = pair.receiver.poll()
    assert [(e.kind, e.request_id) for e in events] == [("failed", "l")]
    assert "lease expired" in (events[0].error or "")
    # A sender may still be writing into them: held until it confirms or the stall timeout.
    pair.check()
    assert pair.decode.block_manager.num_free_blocks < 256
    pair.clock.now += 6
    assert pair.receiver.poll() == []
    pair.idle()


def test_sender_dies_mid_stream_receiver_frees_and_fails(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    pair.start("k", prompt_of(16 * 30, start=12))
    pair.events += pair.sender.step()
    pair.events += pair.receiver.poll()
    # The prefill process dies: its engine and sender are gone, nothing more arrives.
    pair.sender.outgoing.clear()
    pair.prefill.abort("k")
    pair.clock.now += 6
    events = pair.receiver.poll()
    assert [(e.kind, e.request_id) for e in events] == [("failed", "k")]
    assert "stalled" in (events[0].error or "")
    pair.clock.now += 6  # nobody confirms: the held blocks come back after the stall timeout
    assert pair.receiver.poll() == []
    pair.decode.block_manager.check_integrity([])
    assert pair.decode.block_manager.num_free_blocks == 256


def test_missing_acknowledgement_times_out_on_the_sender(model: str) -> None:
    pair = Pair(model)
    pair.p_transport.drop(lambda h: h.get("type") == "pages")
    pair.start("t", prompt_of(40))
    pair.events += pair.sender.step()
    pair.clock.now += 6
    events = pair.sender.poll() + pair.receiver.poll()
    assert ("failed", "t") in [(e.kind, e.request_id) for e in events]
    pair.idle()


def test_manifest_mismatch_is_refused(model: str, tiny_checkpoint: Any) -> None:
    other = str(tiny_checkpoint(arch="qwen3", seed=10, head_dim=32))
    pair = Pair(model, decode_model=other)
    pair.start("m", prompt_of(40))
    events = pair.pump()
    failed = [e for e in events if e.kind == "failed"]
    assert len(failed) == 2  # reported by both sides
    assert all("namespace" in (e.error or "") for e in failed)
    pair.idle()


def test_wrong_token_cannot_connect(model: str) -> None:
    hub = LocalHub(TOKEN)
    with pytest.raises(TransferError, match="wrong cluster token"):
        FakeTransport("not-the-token", hub=hub)


def test_a_reservation_no_sender_was_granted_is_released_at_once(model: str) -> None:
    """Held blocks wait for the stall timeout only while a sender might still write them: told
    that no sender was handed the grant, the receiver frees them now. Blocks a sender's pages
    reached stay held."""
    pair = Pair(model)
    pair.receiver.reserve("never", prompt_of(16 * 5 + 3), GREEDY)
    assert pair.receiver.release_unwritten("never") == 0  # a live reservation: cancel it first
    assert pair.receiver.cancel("never", "client left")
    assert pair.decode.block_manager.num_free_blocks == 256 - 6
    assert pair.receiver.release_unwritten("never") == 6
    assert not pair.receiver.held and not pair.receiver.busy
    pair.idle()
    assert pair.receiver.release_unwritten("never") == 0  # (once)

    pair.start("written", prompt_of(16 * 30, start=3))
    pair.events += pair.sender.step()  # the first chunk goes
    pair.events += pair.receiver.poll()
    assert pair.receiver.reservations["written"].peer is not None
    assert pair.receiver.cancel("written", "client left")
    assert pair.receiver.release_unwritten("written") == 0  # pages came: held for the sender
    assert pair.receiver.held
    pair.pump()  # the sender confirms the cancel: then they are free
    pair.idle()


def test_a_prefill_that_waits_its_turn_renews_its_reservation(model: str, colocated: LLM) -> None:
    """The prefill worker's queue outlasts the lease (5 s here): its sender renews it, so the
    reservation waits with it and the request is exact; once the sender is gone (no more
    renewals) the lease runs out as before."""
    pair = Pair(model)
    prompt = prompt_of(40)
    grant = pair.receiver.reserve("q", prompt, GREEDY)
    pair.sender.start("q", prompt, GREEDY, grant)  # queued: its engine steps later
    for _ in range(6):  # 12 s of queue, polled as a busy worker polls
        pair.clock.now += 2
        pair.events += pair.sender.poll()
        pair.events += pair.receiver.poll()
    assert pair.events == []
    assert "q" in pair.receiver.reservations
    pair.pump()
    assert [e.kind for e in pair.events if e.request_id == "q"] == [
        "first_token",
        "committed",
        "sent",
    ]
    assert pair.decode_all()["q"] == expect(colocated, prompt)[1:]
    pair.idle()

    grant = pair.receiver.reserve("gone", prompt, GREEDY)
    pair.sender.start("gone", prompt, GREEDY, grant)
    pair.clock.now += 2
    pair.events += pair.sender.poll()
    pair.events += pair.receiver.poll()
    pair.sender.outgoing.clear()  # the prefill process dies while the request waits its turn
    pair.prefill.abort("gone")
    pair.clock.now += 6
    events = pair.receiver.poll()
    assert [(e.kind, e.error) for e in events] == [
        ("failed", "lease expired before any page arrived")
    ]


def _revived(pair: Pair) -> None:
    """A new prefill process in place of a dead one (engine, transport and sender)."""
    pair.prefill = LLM(
        model=pair.prefill.config.model, num_kv_blocks=256, max_num_batched_tokens=128
    ).engine
    pair.p_transport = FakeTransport(TOKEN, hub=pair.d_transport.hub)
    pair.sender = KVSender(pair.prefill, pair.p_transport, ack_timeout_s=5, clock=pair.clock)


def test_a_sender_that_is_gone_fails_its_stream_and_frees_the_blocks_at_once(
    model: str, colocated: LLM
) -> None:
    """A transport that knows the sender's process ended (``peer_gone``, after all it sent)
    frees what decode reserved for it now, not after the stall timeout: nothing can write
    those blocks any more."""
    pair = Pair(model)
    pair.start("k", prompt_of(16 * 30, start=12))
    pair.events += pair.sender.step()
    pair.events += pair.receiver.poll()
    assert pair.receiver.reservations["k"].peer == pair.p_transport.address
    pair.sender.outgoing.clear()  # its process dies: nothing more is sent ...
    pair.p_transport.close()  # ... and the transport says so (a local endpoint at its close)
    events = pair.receiver.poll()  # (no time passes)
    assert [(e.kind, e.request_id, e.error) for e in events] == [
        ("failed", "k", "its sender is gone")
    ]
    assert not pair.receiver.held and not pair.receiver.reservations
    pair.decode.block_manager.check_integrity([])
    assert pair.decode.block_manager.num_free_blocks == 256
    _revived(pair)
    next_request_is_exact(pair, colocated)


def test_blocks_held_for_a_lost_sender_go_back_once_the_transport_says_it_is_gone(
    model: str,
) -> None:
    """Reservations cancelled before any page came do not know their sender; the router names
    the prefill worker it handed the grant to and lost (`release_from_lost_sender`). Their
    blocks go back when the transport reports that sender gone, before or after the naming;
    blocks of a sender that is not gone stay held until the stall timeout."""
    pair = Pair(model)
    sender = pair.p_transport.address
    for i, rid in enumerate(("named-first", "named-after", "other-sender", "unnamed")):
        pair.receiver.reserve(rid, prompt_of(16 * 5 + 3, start=100 * i + 1), GREEDY)
        assert pair.receiver.cancel(rid, "client left")
    assert pair.decode.block_manager.num_free_blocks == 256 - 4 * 6
    assert pair.receiver.release_from_lost_sender("named-first", sender) == 0  # not gone yet
    pair.p_transport.close()
    assert pair.receiver.poll() == []
    assert [h.request_id for h in pair.receiver.held] == ["named-after", "other-sender", "unnamed"]
    assert pair.receiver.release_from_lost_sender("named-after", sender) == 6
    assert pair.receiver.release_from_lost_sender("other-sender", "local:99") == 0
    assert [h.request_id for h in pair.receiver.held] == ["other-sender", "unnamed"]
    assert pair.decode.block_manager.num_free_blocks == 256 - 2 * 6
    pair.clock.now += 6  # the rest: the stall timeout, as before
    assert pair.receiver.poll() == []
    pair.decode.block_manager.check_integrity([])
    assert pair.decode.block_manager.num_free_blocks == 256


def test_a_broken_link_to_a_sender_that_may_live_holds_the_blocks(model: str) -> None:
    """A transport error on decode's side (its link to the sender broke) fails the transfer,
    but the sender may still live and the transport still deliver what it wrote: the blocks
    are held for the stall timeout, not freed at once."""
    pair = Pair(model)
    pair.start("t", prompt_of(16 * 30, start=14))
    pair.events += pair.sender.step()
    pair.events += pair.receiver.poll()
    sender = pair.p_transport.address
    error = {"type": "transport_error", "peer": sender, "request_id": "t", "error": "link lost"}
    pair.d_transport._inbox.put(Message(sender, error))
    events = pair.receiver.poll()
    assert [(e.kind, e.request_id) for e in events] == [("failed", "t")]
    assert [h.request_id for h in pair.receiver.held] == ["t"]
    assert pair.decode.block_manager.num_free_blocks < 256
    pair.clock.now += 6
    pair.receiver.poll()
    assert not pair.receiver.held
    pair.decode.block_manager.check_integrity([])
    assert pair.decode.block_manager.num_free_blocks == 256
