"""The transfer protocol over the in-process fake transport: streaming and exactness
(cancels and faults: `test_kv_protocol_faults.py`)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from tandem import LLM, SamplingParams
from tandem.kv_transfer.base import EncodedHeader
from tandem.kv_transfer.events import TransferEvent
from tandem.kv_transfer.manifest import ChunkManifest, TransferError
from tests import kv_protocol_pair
from tests.kv_protocol_pair import (
    GREEDY,
    Pair,
    expect,
    prompt_of,
)

model = kv_protocol_pair.model  # the module-scoped fixtures
colocated = kv_protocol_pair.colocated


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


def test_a_first_token_finish_leaves_its_pages_cached(model: str, colocated: LLM) -> None:
    """A request that ends at the first token (max_tokens 1, or EOS) never runs on decode, but
    the pages it was sent are whole: the next turn of its conversation reuses them."""
    pair = Pair(model)
    shared = prompt_of(64, start=3)
    pair.start("a", shared + [11, 12, 13], SamplingParams(temperature=0, max_tokens=1))
    assert any(e.kind == "finished_early" and e.request_id == "a" for e in pair.pump())
    pair.idle()
    grant = pair.receiver.reserve("b", shared + [21, 22], GREEDY)
    assert grant.num_hit_blocks == 4 and len(grant.dst_block_ids) == 1
    pair.sender.start("b", shared + [21, 22], GREEDY, grant)
    events = pair.pump()
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


def test_handed_off_chunks_stream_in_order_and_decode_exactly(model: str, colocated: LLM) -> None:
    """With `hand_off` (as prefill workers run), chunks other than the last leave from the
    publishing thread, in order, and the last from the engine's thread after all of them."""
    pair = Pair(model, hand_off=True)
    sent: list[tuple[int, bool, str]] = []
    original = pair.p_transport.deliver

    def spy(peer: str, message: Any) -> None:
        if message.header.get("type") == "pages":
            manifest = message.header["manifest"]
            thread = threading.current_thread().name
            sent.append((manifest["chunk_index"], manifest["last"], thread))
        original(peer, message)

    pair.p_transport.deliver = spy  # type: ignore[method-assign]
    prompt = prompt_of(16 * 41 + 5)
    try:
        pair.start("a", prompt)
        events = pair.pump_until("a", "sent")
        first = next(e.token_ids for e in events if e.kind == "first_token")
        assert list(first) + pair.decode_all()["a"] == expect(colocated, prompt)
        assert [index for index, _, _ in sent] == list(range(len(sent))) and len(sent) >= 5
        assert sent[-1][1:] == (True, "MainThread") and not any(last for _, last, _ in sent[:-1])
        assert "kv-chunk-publisher" in {thread for _, _, thread in sent[:-1]}
        pair.idle()
    finally:
        pair.sender.close()


def test_a_cancel_sends_no_handed_off_chunk_after_it(model: str) -> None:
    pair = Pair(model, hand_off=True)
    try:
        pair.start("b", prompt_of(16 * 60))
        for _ in range(3):
            pair.events += pair.sender.step()
        deadline = time.monotonic() + 10
        while not any(h.get("type") == "pages" for h in pair.p_transport.sent):
            assert time.monotonic() < deadline, "no chunk left the publishing thread"
            time.sleep(0.005)
        pair.events += pair.sender.step()  # (one more chunk, likely still queued)
        assert pair.sender.cancel("b")
        events = pair.pump_until("b", "cancelled")
        time.sleep(0.1)  # (a chunk the publisher still held would have gone by now)
        kinds = [h.get("type") for h in pair.p_transport.sent if h.get("request_id") == "b"]
        assert kinds.count("cancel") == 1 and kinds[0] == "pages"
        assert "pages" not in kinds[kinds.index("cancel") :]
        assert [e.kind for e in events if e.request_id == "b"][-1] == "cancelled"
        pair.idle()
    finally:
        pair.sender.close()
