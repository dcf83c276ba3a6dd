"""Doorbells (`kv_transfer/_doorbell.py`): a ring wakes the bell's waiting thread at once and
names the bell it came from, a bell nobody rings sleeps its whole timeout, rings are cleared by
the wait that sees them, and an endpoint that could not bind its name still wakes itself (its
rings then come unnamed)."""

from __future__ import annotations

import threading
import time

from tandem.kv_transfer._doorbell import Doorbell, bell_name


def timed_wait(bell: Doorbell, timeout: float, rang: set[bytes] | None = None) -> float:
    start = time.monotonic()
    names = bell.wait(timeout)
    if rang is not None:
        assert names == rang
    return time.monotonic() - start


def test_a_ring_from_another_endpoint_wakes_the_waiting_thread() -> None:
    ringer, bell = Doorbell("ucx:aa01"), Doorbell("ucx:bb02")
    try:
        assert ringer.bound and bell.bound and bell.name == bell_name("ucx:bb02")
        assert bell_name("ucx:aa01") != bell_name("ucx:bb02")
        assert timed_wait(bell, 0.05, set()) >= 0.04  # nobody rang: the whole timeout
        threading.Timer(0.05, ringer.ring, args=(bell.name,)).start()
        assert timed_wait(bell, 10.0, {ringer.name}) < 5.0
        ringer.ring(bell.name)
        ringer.ring(bell.name)
        bell.wake()  # (its own: not named)
        assert timed_wait(bell, 10.0, {ringer.name}) < 5.0  # three rings, one wake
        assert timed_wait(bell, 0.05, set()) >= 0.04
        ringer.ring(bell_name("ucx:nobody-here"))  # (a bell that does not exist: no error)
    finally:
        ringer.close()
        bell.close()


def test_an_endpoint_whose_name_is_taken_still_wakes_itself() -> None:
    first, second = Doorbell("ucx:cc03"), Doorbell("ucx:cc03")
    try:
        assert first.bound and not second.bound
        threading.Timer(0.05, second.wake).start()
        assert timed_wait(second, 10.0) < 5.0
        assert timed_wait(second, 0.05) >= 0.04
        second.ring(first.name)  # (it can still ring others, unnamed)
        assert timed_wait(first, 10.0, set()) < 5.0
    finally:
        first.close()
        second.close()
    first.ring(second.name)  # (closed: nothing happens)
    assert timed_wait(first, 0.01) < 5.0
