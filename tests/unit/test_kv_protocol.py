"""The transfer protocol over the in-process fake transport: streaming, exactness and faults."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.kv_transfer.base import EncodedHeader
from tandem.kv_transfer.events import TransferEvent
from tandem.kv_transfer.fake import FakeTransport
from tandem.kv_transfer.local import LocalHub
from tandem.kv_transfer.manifest import ChunkManifest, TransferError
from tandem.kv_transfer.receiver import KVReceiver
from tandem.kv_transfer.sender import KVSender

TOKEN = "cluster-secret"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pair:
    """A prefill engine + sender and a decode engine + receiver joined by fake transports."""

    def __init__(self, model: str, decode_model: str | None = None, chunk_blocks: int = 8) -> None:
        self.clock = Clock()
        hub = LocalHub(TOKEN)
        self.prefill = LLM(
            model=model, num_kv_blocks=256, max_num_batched_tokens=16 * chunk_blocks
        ).engine
        self.decode = LLM(model=decode_model or model, num_kv_blocks=256).engine
        self.p_transport = FakeTransport(TOKEN, hub=hub)
        self.d_transport = FakeTransport(TOKEN, hub=hub)
        self.sender = KVSender(self.prefill, self.p_transport, ack_timeout_s=5, clock=self.clock)
        self.receiver = KVReceiver(
            self.decode, self.d_transport, lease_s=5, stall_timeout_s=5, clock=self.clock
        )
        self.events: list[TransferEvent] = []

    def start(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        grant = self.receiver.reserve(rid, prompt, params)
        self.sender.start(rid, prompt, params, grant)

    def pump(self, steps: int = 200) -> list[TransferEvent]:
        for _ in range(steps):
            self.events += self.sender.step()
            self.events += self.receiver.poll()
            self.events += self.sender.poll()
            idle = not self.sender.outgoing and not self.receiver.reservations
            if idle and not self.receiver.held:
                break
        return self.events

    def decode_all(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        while self.decode.has_unfinished_requests():
            for out in self.decode.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    def check(self) -> None:
        self.prefill.check_integrity()
        tables = [r.block_table for r in self.decode.requests.values() if r.block_table]
        self.decode.block_manager.check_integrity(tables + self.receiver.block_tables())
        for engine in (self.prefill, self.decode):
            bm = engine.block_manager
            assert all(bm.pin_count(b) == 0 for b in range(bm.num_blocks))

    def idle(self) -> None:
        """Both sides hold nothing: every block is back in the free queue."""
        self.check()
        for engine in (self.prefill, self.decode):
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint(arch="qwen3", seed=9, head_dim=32))


@pytest.fixture(scope="module")
def colocated(model: str) -> LLM:
    return LLM(model=model, num_kv_blocks=256)


def expect(colocated: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return colocated.generate([prompt], params)[0].token_ids


def prompt_of(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % 500 + 1 for i in range(n)]


def test_streams_chunks_during_prefill_and_decodes_exactly(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    prompt = prompt_of(16 * 41 + 5)  # 42 blocks, the last one partial
    statuses: list[int] = []
    original = pair.p_transport.deliver

    def spy(peer: str, message: Any) -> None:
        if message.header.get("type") == "pages":
            statuses.append(pair.prefill.requests["a"].num_computed_tokens)
        original(peer, message)

    pair.p_transport.deliver = spy  # type: ignore[method-assign]
    pair.start("a", prompt)
    events = pair.pump()
    assert [e.kind for e in events if e.request_id == "a"] == ["first_token", "committed", "sent"]
    assert len(statuses) >= 5
    assert statuses[0] < len(prompt), "the first chunk must leave before prefill finishes"
    first = next(e.token_ids for e in events if e.kind == "first_token")
    assert list(first) + pair.decode_all()["a"] == expect(colocated, prompt)
    pair.idle()


def test_one_acknowledgement_covers_the_stream_and_unpins_every_chunk(model: str) -> None:
    """The receiver acknowledges the last chunk only (each reply costs the prefill engine's
    thread); the sender keeps every chunk pinned until then and unpins them all on it."""
    pair = Pair(model)
    acks: list[int] = []
    pinned_before_ack: list[int] = []
    original_d, original_p = pair.d_transport.deliver, pair.p_transport.deliver

    def spy_decode(peer: str, message: Any) -> None:
        if message.header.get("type") == "ack":
            acks.append(message.header["chunk_index"])
            bm = pair.prefill.block_manager
            pinned_before_ack.append(sum(bm.pin_count(b) > 0 for b in range(bm.num_blocks)))
        original_d(peer, message)

    chunks: list[int] = []

    def spy_prefill(peer: str, message: Any) -> None:
        if message.header.get("type") == "pages":
            chunks.append(len(message.header["manifest"]["src_block_ids"]))
        original_p(peer, message)

    pair.d_transport.deliver = spy_decode  # type: ignore[method-assign]
    pair.p_transport.deliver = spy_prefill  # type: ignore[method-assign]
    pair.start("k", prompt_of(16 * 30 + 2))  # 31 blocks in chunks of 8
    events = pair.pump()
    assert [e.kind for e in events if e.request_id == "k"] == ["first_token", "committed", "sent"]
    assert len(chunks) >= 4 and sum(chunks) == 31
    assert acks == [len(chunks) - 1]
    assert pinned_before_ack == [31]  # every chunk stayed pinned until the one ack
    bm = pair.prefill.block_manager
    assert sum(bm.pin_count(b) > 0 for b in range(bm.num_blocks)) == 0
    pair.decode_all()
    pair.idle()


def test_manifests_are_written_as_the_model_dumps_them(model: str) -> None:
    """The sender writes manifests as plain dicts (a hot path): each must equal what
    `ChunkManifest` validates and dumps, field for field."""
    pair = Pair(model)
    sent: list[dict[str, Any]] = []
    original = pair.p_transport.deliver

    def spy(peer: str, message: Any) -> None:
        if message.header.get("type") == "pages":
            sent.append(message.header["manifest"])
        original(peer, message)

    pair.p_transport.deliver = spy  # type: ignore[method-assign]
    texts: list[EncodedHeader] = []
    send = pair.p_transport.send

    def spy_send(peer: str, header: dict[str, Any], src_block_ids: Any = ()) -> None:
        if header.get("type") == "pages":
            assert isinstance(header, EncodedHeader)
            texts.append(header)
        send(peer, header, src_block_ids)

    pair.p_transport.send = spy_send  # type: ignore[method-assign]
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=4)
    pair.start("m", prompt_of(16 * 20 + 3), seeded)
    pair.pump()
    assert len(sent) >= 3 and sent[-1]["last"] and sent[-1]["sampler_state"]
    for wire in sent:
        assert ChunkManifest.model_validate(wire).model_dump(mode="json") == wire
    # What the socket transports send instead of encoding the dict: the same JSON.
    assert [json.loads(h.text) for h in texts] == [dict(h) for h in texts]
    assert [json.loads(h.text)["manifest"] for h in texts] == sent
    pair.decode_all()
    pair.idle()


def test_compute_hands_out_the_first_token_before_the_last_chunk_goes(model: str) -> None:
    pair = Pair(model)
    pair.start("f", prompt_of(16 * 3 + 2))
    first: list[TransferEvent] = []
    while not first:
        first = [e for e in pair.sender.compute() if e.kind == "first_token"]
        if not first:
            pair.sender.stream()
    assert not pair.sender.outgoing["f"].last_sent  # the last chunk is still to go
    assert [e.kind for e in pair.sender.stream()] == []
    assert pair.sender.outgoing["f"].last_sent
    assert pair.sender.send_work_s > 0
    pair.pump()
    assert [e.kind for e in pair.events] == ["committed", "sent"]
    pair.decode_all()
    pair.idle()


def test_a_send_the_transport_refuses_fails_the_request_and_unpins(model: str) -> None:
    """e.g. a reservation naming an address the transport cannot reach: the request fails
    (the prefill worker's loop goes on), its blocks are released."""
    pair = Pair(model)
    original = pair.p_transport.send

    def send(peer: str, header: dict[str, Any], src_block_ids: Any = ()) -> None:
        if header.get("type") == "pages" and header["manifest"]["chunk_index"] == 1:
            raise TransferError("link lost")
        original(peer, header, src_block_ids)

    pair.p_transport.send = send  # type: ignore[method-assign]
    pair.start("x", prompt_of(16 * 30 + 1))
    events = pair.pump()
    failed = [e for e in events if e.request_id == "x" and e.kind == "failed"]
    assert failed and "could not send the pages: link lost" in (failed[0].error or "")
    pair.clock.now += 10  # the receiver's lease on the reservation runs out
    pair.pump()
    pair.idle()


def test_decode_side_prefix_reuse_sends_only_missing_blocks(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    shared = prompt_of(64, start=3)
    pair.start("a", shared + [11, 12, 13])
    pair.pump()
    pair.decode_all()
    grant = pair.receiver.reserve("b", shared + [21, 22], GREEDY)
    assert grant.num_hit_blocks == 4 and len(grant.dst_block_ids) == 1
    pair.sender.start("b", shared + [21, 22], GREEDY, grant)
    events = pair.pump()
    sent_blocks = sum(
        len(h["manifest"]["dst_block_ids"])
        for h in pair.p_transport.sent
        if h.get("request_id") == "b" and h["type"] == "pages"
    )
    assert sent_blocks == 1
    first = next(e.token_ids for e in events if e.kind == "first_token" and e.request_id == "b")
    assert list(first) + pair.decode_all()["b"] == expect(colocated, shared + [21, 22])
    pair.idle()


def test_seeded_sampling_continues_exactly(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    params = SamplingParams(temperature=0.8, seed=77, max_tokens=12, ignore_eos=True)
    prompt = prompt_of(50, start=9)
    pair.start("s", prompt, params)
    events = pair.pump()
    first = next(e.token_ids for e in events if e.kind == "first_token")
    assert list(first) + pair.decode_all()["s"] == expect(colocated, prompt, params)
    pair.idle()


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
    _next_request_is_exact(pair, colocated)


def test_receiver_cancel_mid_stream_unpins_sender(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    pair.start("c", prompt_of(16 * 30, start=8))
    pair.events += pair.sender.step()
    pair.events += pair.receiver.poll()
    assert pair.receiver.cancel("c")
    events = pair.pump()
    assert ("cancelled", "c") in [(e.kind, e.request_id) for e in events]
    pair.idle()
    _next_request_is_exact(pair, colocated)


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
    _next_request_is_exact(pair, colocated)


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
    _next_request_is_exact(pair, colocated)


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


def _next_request_is_exact(pair: Pair, colocated: LLM) -> None:
    prompt = prompt_of(16 * 12 + 3, start=40)
    pair.events = []
    pair.start("next", prompt)
    events = pair.pump()
    first = next(e.token_ids for e in events if e.kind == "first_token")
    assert list(first) + pair.decode_all()["next"] == expect(colocated, prompt)
    pair.idle()
