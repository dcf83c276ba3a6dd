"""Cross-memory attach (`process_vm_writev`) as the shm transport uses it."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import socket

import pytest

from tandem.kv_transfer import _cross_memory

needs_cross_memory = pytest.mark.skipif(
    not _cross_memory.available(), reason="cross-memory attach not allowed here"
)


@needs_cross_memory
def test_write_copies_every_run_into_the_target() -> None:
    source = ctypes.create_string_buffer(bytes(range(64)), 64)
    target = ctypes.create_string_buffer(64)
    src, dst = ctypes.addressof(source), ctypes.addressof(target)
    _cross_memory.write(os.getpid(), [(src, dst + 32, 16), (src + 40, dst, 8)])
    assert target.raw[32:48] == bytes(range(16))
    assert target.raw[0:8] == bytes(range(40, 48))
    assert target.raw[8:32] == bytes(24) and target.raw[48:] == bytes(16)


@needs_cross_memory
def test_a_process_that_is_gone_is_reported() -> None:
    child = mp.get_context("spawn").Process(target=int)
    child.start()
    child.join()
    source = ctypes.create_string_buffer(8)
    with pytest.raises(ProcessLookupError):
        _cross_memory.write(child.pid or 0, [(ctypes.addressof(source), 4096, 8)])


@needs_cross_memory
def test_a_bad_target_address_is_an_error_not_a_crash() -> None:
    source = ctypes.create_string_buffer(8)
    with pytest.raises(OSError) as err:
        _cross_memory.write(os.getpid(), [(ctypes.addressof(source), 8, 8)])
    assert not isinstance(err.value, PermissionError)


def test_peer_pid_is_the_kernels_answer() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert _cross_memory.peer_pid(a) == os.getpid()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        assert _cross_memory.peer_pid(tcp) is None


def test_unavailable_where_yama_restricts_ptrace(monkeypatch: pytest.MonkeyPatch) -> None:
    _cross_memory.available.cache_clear()
    monkeypatch.setattr(_cross_memory, "_ptrace_scope", lambda: 1)
    try:
        assert _cross_memory.available() is False
    finally:
        _cross_memory.available.cache_clear()


def test_copies_are_cut_into_calls_of_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux copies at most ~2 GiB per call: runs go in calls of at most `CALL_BYTES` bytes
    and `IOV_MAX` iovecs (a longer run cut), in order, and every byte still arrives."""
    cut = _cross_memory._cut  # (what `_copy` does with `CALL_BYTES` and `IOV_MAX`)
    assert cut([(0, 1000, 250), (5000, 7000, 30)], 100, _cross_memory.IOV_MAX) == [
        [(0, 1000, 100)],
        [(100, 1100, 100)],
        [(200, 1200, 50), (5000, 7000, 30)],
    ]
    assert [len(b) for b in cut([(i, i, 1) for i in range(5)], 100, 2)] == [2, 2, 1]
    monkeypatch.setattr(_cross_memory, "CALL_BYTES", 100)
    monkeypatch.setattr(_cross_memory, "IOV_MAX", 2)
    if _cross_memory._syscall("process_vm_readv") is not None:
        source = ctypes.create_string_buffer(bytes(range(256)), 256)
        target = ctypes.create_string_buffer(256)
        runs = [(ctypes.addressof(target), ctypes.addressof(source), 256)]
        _cross_memory.read(os.getpid(), runs)
        assert target.raw == bytes(range(256))
