"""The acks a UCX endpoint polls for (`_ucx_replies.AwaitedReplies`); no UCX needed."""

from __future__ import annotations

from typing import Any

from tandem.kv_transfer._ucx_replies import REPLY_WINDOW_S, AwaitedReplies


def chunk(rid: str, index: int, last: bool) -> dict[str, Any]:
    return {"type": "pages", "request_id": rid, "manifest": {"chunk_index": index, "last": last}}


def test_only_a_last_chunk_is_awaited() -> None:
    replies = AwaitedReplies()
    assert replies.sent(chunk("r1", 0, False), 0.0) is False
    assert replies.sent({"type": "ack", "request_id": "r1", "chunk_index": 0}, 0.0) is False
    assert replies.sent({"type": "pages", "request_id": "r1"}, 0.0) is False
    assert not replies.pending(0.0)
    assert replies.sent(chunk("r1", 3, True), 0.0) is True
    assert replies.pending(0.0)


def test_the_ack_of_the_last_chunk_ends_the_wait_an_earlier_one_does_not() -> None:
    replies = AwaitedReplies()
    replies.sent(chunk("r1", 3, True), 0.0)
    replies.sent(chunk("r2", 0, True), 0.0)
    replies.answered({"type": "ack", "request_id": "r1", "chunk_index": 2})
    replies.answered({"type": "ack", "request_id": "other", "chunk_index": 9})
    assert replies.pending(0.0)
    replies.answered({"type": "ack", "request_id": "r1", "chunk_index": 3})
    assert replies.pending(0.0)  # (r2 still)
    replies.answered({"type": "cancel", "request_id": "r2"})  # any other answer ends it too
    assert not replies.pending(0.0)


def test_an_unanswered_chunk_is_awaited_for_the_window_only() -> None:
    replies = AwaitedReplies()
    replies.sent(chunk("r1", 0, True), 10.0)
    assert replies.pending(10.0 + REPLY_WINDOW_S / 2)
    assert not replies.pending(10.0 + REPLY_WINDOW_S)
