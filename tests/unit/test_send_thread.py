"""`SendThread`: a sender's transport calls in order on one thread; failures come back."""

from __future__ import annotations

import threading

from tandem.kv_transfer.send_thread import SendThread


def test_calls_run_in_order_on_one_thread_and_close_runs_what_is_queued() -> None:
    sends = SendThread()
    seen: list[tuple[int, str]] = []
    gate = threading.Event()
    sends.post("a", gate.wait)  # holds the thread while the rest is queued
    for i in range(50):
        sends.post(f"r{i}", lambda i=i: seen.append((i, threading.current_thread().name)))
    gate.set()
    sends.close()
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"kv-send"}
    assert sends.failures() == []


def test_a_call_that_raises_is_reported_with_its_request_and_the_rest_go_on() -> None:
    sends = SendThread()
    after: list[str] = []

    def fail() -> None:
        raise RuntimeError("peer gone")

    sends.post("bad", fail)
    sends.post("good", lambda: after.append("good"))
    sends.close()
    assert sends.failures() == [("bad", "RuntimeError: peer gone")]
    assert sends.failures() == []  # reported once
    assert after == ["good"]
