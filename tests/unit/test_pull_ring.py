"""The record ring of the shm transport's pull path: order, wrap-around, a full ring."""

from __future__ import annotations

import pytest

from tandem.kv_transfer._pull_ring import ASLEEP, AWAKE, CONTROL_BYTES, POLLING_SLOWLY, RecordRing


def ring(data_bytes: int) -> RecordRing:
    return RecordRing(memoryview(bytearray(CONTROL_BYTES + data_bytes)))


def test_records_come_out_in_order_and_whole() -> None:
    r = ring(1024)
    payloads = [b"", b"a", b"x" * 7, b"y" * 8, b"z" * 9, '{"caf\u00e9": 1}'.encode()]
    assert all(r.write(p) for p in payloads)
    assert r.has_records()
    assert r.read() == payloads
    assert not r.has_records() and r.read() == []


def test_a_full_ring_refuses_until_read_and_wraps_without_tearing_a_record() -> None:
    r = ring(256)
    record = bytes(range(50))  # 8 + 56 bytes each
    written = 0
    while r.write(record):
        written += 1
    assert written == 4  # 4 x 64 = 256
    assert r.read() == [record] * 4
    for round_ in range(20):  # sizes that do not divide the ring: records wrap at its end
        batch = [bytes([round_]) * (30 + 11 * i) for i in range(3)]
        assert all(r.write(p) for p in batch)
        assert r.read() == batch


def test_a_record_larger_than_the_ring_is_refused() -> None:
    r = ring(64)
    assert not r.write(b"q" * 57)
    assert r.write(b"q" * 56)
    assert r.read() == [b"q" * 56]


def test_the_reader_state() -> None:
    r = ring(64)
    assert r.reader_state == AWAKE
    for state in (ASLEEP, POLLING_SLOWLY, AWAKE):
        r.set_state(state)
        assert r.reader_state == state


def test_a_buffer_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError):
        RecordRing(memoryview(bytearray(CONTROL_BYTES)))
    with pytest.raises(ValueError):
        RecordRing(memoryview(bytearray(CONTROL_BYTES + 12)))
