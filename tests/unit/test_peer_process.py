"""Which process sent over a transport connection, and whether it has ended (`_peer_process`):
what lets a receiver free blocks a dead sender held at once instead of after its stall timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tandem.kv_transfer._peer_process import identity, process_ended, sender_pid

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")


@pytest.fixture
def tcp_pair() -> Iterator[socket.socket]:
    """The accepted end of a TCP connection on the loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        yield accepted
        accepted.close()
        client.close()


def test_a_unix_sockets_sender_is_named_by_the_kernel_not_by_its_hello() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    with ours, theirs:
        assert sender_pid(ours, {"process": {**identity(), "pid": 1}}) == os.getpid()


def test_a_tcp_sender_is_believed_only_on_this_machine_in_this_pid_namespace(
    tcp_pair: socket.socket,
) -> None:
    me = identity()
    assert sender_pid(tcp_pair, {"process": me}) == os.getpid()
    assert sender_pid(tcp_pair, {"process": {**me, "boot_id": "another-machine"}}) is None
    assert sender_pid(tcp_pair, {"process": {**me, "pid_ns": "pid:[1]"}}) is None  # another pod
    assert sender_pid(tcp_pair, {"process": {**me, "pid": "7"}}) is None
    assert sender_pid(tcp_pair, {"process": {**me, "pid": 0}}) is None
    assert sender_pid(tcp_pair, {}) is None  # (an older sender: the stall timeout, as before)


def test_a_process_has_ended_when_it_is_gone_or_a_zombie_not_while_it_runs() -> None:
    assert not process_ended(os.getpid())
    assert not process_ended(os.getpid(), wait_s=0.05)  # (waited for, in vain)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not process_ended(child.pid):  # exited, not yet reaped: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{child.pid}")
    child.wait()
    assert process_ended(child.pid)  # reaped: gone


def test_waiting_for_a_process_to_end_stops_when_asked() -> None:
    started = time.monotonic()
    assert not process_ended(os.getpid(), wait_s=10, stop=lambda: True)
    assert time.monotonic() - started < 1
