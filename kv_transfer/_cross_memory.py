"""Cross-memory attach: one process copies pages straight into or out of another's memory.

Linux's `process_vm_writev` copies between two address spaces in one system call, with no shared
mapping. The shm transport uses it to write pages into a receiver's pool that lives in private
memory on transparent huge pages: POSIX shared memory gets no huge pages on most kernels
(``shmem_enabled`` is ``never``), and a copy into 4 KiB pages costs a TLB miss per page. In a
2-core VM a 1 MiB chunk went at ~13 GB/s this way, against ~9 GB/s into a shared region
(and ~5.5 GB/s for `process_vm_writev` into 4 KiB pages: the kernel pins them one by one).

The kernel allows it only where the writer could ptrace the target: same user, and Yama's
``ptrace_scope`` at 0 (or absent). `available()` checks that once per process; a write that is
refused anyway raises `PermissionError` and the caller stages instead. The shm transport's target
is always the process at the other end of a Unix socket, as the kernel reports it (`peer_pid`),
never a pid a peer names, so a write can only land in the process the link is connected to. The
ucx transport only *reads* (`pool_in_process`), from the pid an authenticated sender's hello
names on this machine (`_peer_process.claimed_pid`): a peer holding the cluster token is trusted
to name itself there, as for ``peer_gone``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer._socket_channel import (
    FrameError,
    consecutive_runs,
    dtype_name,
    parse_dtype,
    parse_shape,
)

IOV_MAX = 1024
"""Most iovecs one call takes (Linux's UIO_MAXIOV)."""
CALL_BYTES = 1 << 30
"""Most bytes one call is given (Linux copies at most ~2 GiB per call, MAX_RW_COUNT)."""


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


@functools.cache
def _syscall(name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's `process_vm_writev` or `process_vm_readv`, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn


def _ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0  # no Yama: the classic same-user rule applies


@functools.cache
def available() -> bool:
    """Whether this process may write into its peers' memory: Linux, the call present and not
    filtered out (a write into this process works), and Yama not restricting ptrace."""
    if _syscall("process_vm_writev") is None or _ptrace_scope() != 0:
        return False
    target = ctypes.create_string_buffer(8)
    source = ctypes.create_string_buffer(b"tandem!", 8)
    try:
        write(os.getpid(), [(ctypes.addressof(source), ctypes.addressof(target), 8)])
    except OSError:
        return False
    return target.raw == source.raw


def can_read() -> bool:
    """Whether this process has `process_vm_readv` at all; whether a given peer may be read is
    `allowed`'s question (Yama's ``ptrace_scope`` 1 allows it where the peer let anyone
    trace it, as UCX's CMA transport does in every process that loads it)."""
    return _syscall("process_vm_readv") is not None


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a connected Unix socket (from the kernel)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or sock.family != getattr(socket, "AF_UNIX", None):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return None
    pid = struct.unpack("3i", raw)[0]
    return pid if pid > 0 else None


def write(pid: int, runs: Sequence[tuple[int, int, int]]) -> None:
    """Copies each `(local_address, remote_address, nbytes)` run from this process into `pid`.

    Raises `PermissionError` where the kernel refuses (EPERM/EACCES/ENOSYS), `ProcessLookupError`
    for a process that is gone, `OSError` for anything else, including a short copy."""
    _copy("process_vm_writev", pid, runs)


def read(pid: int, runs: Sequence[tuple[int, int, int]]) -> None:
    """Copies each `(local_address, remote_address, nbytes)` run from `pid` into this process
    (raises as `write`)."""
    _copy("process_vm_readv", pid, runs)


def allowed(pid: int, address: int) -> bool:
    """Whether the kernel lets this process read and write `pid`'s memory: reads one byte at
    `address` there (the same permission check as a write, and harmless). Raises as `write` for
    other errors."""
    probe = ctypes.create_string_buffer(1)
    try:
        _copy("process_vm_readv", pid, [(ctypes.addressof(probe), address, 1)])
    except PermissionError:
        return False
    return True


def _cut(
    runs: Sequence[tuple[int, int, int]], max_bytes: int, max_runs: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """`(local, remote, nbytes)` copies in consecutive lists of at most `max_bytes` bytes (> 0)
    and `max_runs` copies each, a run cut where a list fills; in order, none empty."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = max_bytes
    for local, remote, n in runs:
        while n:
            if room == 0 or len(out[-1]) == max_runs:
                out.append([])
                room = max_bytes
            take = min(n, room)
            out[-1].append((local, remote, take))
            local, remote, n, room = local + take, remote + take, n - take, room - take
    return [part for part in out if part]


def _copy(name: str, pid: int, runs: Sequence[tuple[int, int, int]]) -> None:
    fn = _syscall(name)
    if fn is None:
        raise PermissionError(errno.ENOSYS, f"{name} is not available")
    for batch in _cut(runs, CALL_BYTES, IOV_MAX):  # (calls' worth, a longer run cut)
        local = (_IOVec * len(batch))(*[_IOVec(src, n) for src, _, n in batch])
        remote = (_IOVec * len(batch))(*[_IOVec(dst, n) for _, dst, n in batch])
        total = sum(n for _, _, n in batch)
        done = fn(pid, local, len(batch), remote, len(batch), 0)
        if done < 0:
            code = ctypes.get_errno()
            if code in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                raise PermissionError(code, f"{name}: {os.strerror(code)}")
            if code == errno.ESRCH:
                raise ProcessLookupError(code, f"process {pid} is gone")
            raise OSError(code, f"{name}: {os.strerror(code)}")
        if done != total:
            raise OSError(errno.EFAULT, f"{name} copied {done} of {total} bytes")


@dataclass(frozen=True)
class RemotePool:
    """A KV pool in another process: the process, its first byte there, and its geometry."""

    pid: int
    address: int
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        count = self.dtype.itemsize
        for dim in self.block_shape:
            count *= dim
        return count

    def matches(self, pool: KVCachePool) -> bool:
        """Whether `pool` holds blocks of this one's shape and dtype, in contiguous CPU memory
        (so blocks copy between them as runs of raw bytes)."""
        return (
            pool.block_shape == self.block_shape
            and pool.dtype == self.dtype
            and pool.device.type == "cpu"
            and pool.tensor.is_contiguous()
        )

    def read_runs(self, runs: Any, into: Any) -> None:
        """Copies the blocks of `runs` (``[[first block, count], ...]``, in order) out of this
        pool into `into` (a numpy byte array of exactly their size). ValueError for runs outside
        the pool or of another size, before anything is copied; raises as `read` for the copy."""
        size, address, copies = self.bytes_per_block, into.ctypes.data, []
        for run in runs:
            start, count = run if isinstance(run, list) and len(run) == 2 else (None, None)
            if not (isinstance(start, int) and isinstance(count, int) and count > 0):
                raise ValueError(f"bad run {run!r}")
            if not 0 <= start <= self.num_blocks - count:
                raise ValueError(f"blocks {start}..{start + count} are not in the offered pool")
            copies.append((address, self.address + start * size, count * size))
            address += count * size
        if address - into.ctypes.data != into.nbytes:
            raise ValueError(f"runs of {address - into.ctypes.data} bytes for {into.nbytes}")
        read(self.pid, copies)

    def runs(
        self, local_base: int, local_ids: Sequence[int], remote_ids: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """`(local_address, remote_address, nbytes)` runs for blocks `local_ids[i]` (at
        `local_base`) <-> `remote_ids[i]`, consecutive ids merged."""
        size = self.bytes_per_block
        return [
            (local_base + a * size, self.address + b * size, n * size)
            for a, b, n in consecutive_runs(local_ids, remote_ids)
        ]


def describe(pool: KVCachePool) -> dict[str, Any]:
    """How a peer finds `pool` in this process (see `remote_pool`)."""
    return {
        "pid": os.getpid(),
        "address": pool.tensor.data_ptr(),
        "num_blocks": pool.num_blocks,
        "block_shape": list(pool.block_shape),
        "dtype": dtype_name(pool.dtype),
    }


def remote_pool(described: object, sock: socket.socket) -> RemotePool | None:
    """The pool a peer `describe`d, if it lives in the process at the other end of `sock` (the
    kernel says which) and the kernel lets this process reach that process's memory; else None.
    `FrameError` for a description that is not well formed."""
    return pool_in_process(described, peer_pid(sock))


def pool_in_process(described: object, expected_pid: int | None) -> RemotePool | None:
    """The pool a peer `describe`d, if it lives in process `expected_pid` and the kernel lets this
    process reach that process's memory; else None (`FrameError` as `remote_pool`)."""
    if not isinstance(described, dict):
        raise FrameError(f"bad pool description {described!r}")
    pid, address, num_blocks = parse_shape(
        [described.get("pid"), described.get("address"), described.get("num_blocks")], 3
    )
    place = RemotePool(
        pid,
        address,
        num_blocks,
        parse_shape(described.get("block_shape"), 5),
        parse_dtype(described.get("dtype")),
    )
    if pid != expected_pid or not address:
        return None
    return place if allowed(pid, address) else None


def split_runs(
    runs: list[tuple[int, int, int]], parts: int, align: int = 4096
) -> list[list[tuple[int, int, int]]]:
    """`(local, remote, nbytes)` copies cut into at most `parts` lists of about equal bytes, in
    order; a run is cut at a multiple of `align` bytes from its start. Empty lists are left out."""
    total = sum(n for _, _, n in runs)
    return _cut(runs, -(-total // max(1, parts) // align) * align) if total else []
