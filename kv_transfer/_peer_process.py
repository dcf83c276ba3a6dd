"""Which process is at the other end of a transport's connection, and whether it has ended.

A receiver may free blocks that a sender could still write into only once the sender's process
has ended (`tandem.kv_transfer.base`, ``peer_gone``). The process of a Unix socket's peer comes
from the kernel (`_cross_memory.peer_pid`); over TCP the sender's hello names its pid, its
machine's boot id and its pid namespace, and the pid is used only when both are this process's
(two pods of one node share the boot id, not the pid namespace). An authenticated peer, one
that holds the cluster token, is trusted to name itself.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from tandem.kv_transfer import _cross_memory


@functools.cache
def boot_id() -> str | None:
    """This machine's boot id (Linux), None where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


@functools.cache
def pid_namespace() -> str | None:
    """This process's pid namespace (e.g. ``pid:[4026531836]``), None where it cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """What a hello says of the sending process (``process`` field)."""
    return {"pid": os.getpid(), "boot_id": boot_id(), "pid_ns": pid_namespace()}


def sender_pid(sock: socket.socket, hello: dict[str, Any]) -> int | None:
    """The pid of the process that connected `sock` and sent `hello`: the kernel's for a Unix
    socket, else the hello's own if it runs on this machine in this pid namespace; None if
    unknown."""
    if sock.family == getattr(socket, "AF_UNIX", None):
        return _cross_memory.peer_pid(sock)
    return claimed_pid(hello)


def claimed_pid(hello: dict[str, Any]) -> int | None:
    """The pid `hello` names (its ``process`` field, `identity`), if the sender runs on this
    machine in this pid namespace; else None."""
    claimed = hello.get("process")
    if not isinstance(claimed, dict) or boot_id() is None or pid_namespace() is None:
        return None
    pid = claimed.get("pid")
    here = (claimed.get("boot_id"), claimed.get("pid_ns")) == (boot_id(), pid_namespace())
    return pid if here and isinstance(pid, int) and pid > 0 else None


def process_ended(pid: int, wait_s: float = 0.0, stop: Callable[[], bool] = lambda: False) -> bool:
    """Whether process `pid` has ended (gone, or every thread of it a zombie: no memory left
    to write from), waiting up to `wait_s` seconds (or until `stop()`) for it to. False while
    any thread runs, and where this cannot be told (no /proc)."""
    deadline = time.monotonic() + wait_s
    while not _ended(pid):
        if time.monotonic() >= deadline or stop():
            return False
        time.sleep(0.02)
    return True


def _ended(pid: int) -> bool:
    if not _task_ended(pid, str(pid)):
        return False  # (its main thread runs: no need to read every thread's state)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return all(_task_ended(pid, task) for task in tasks)


def _task_ended(pid: int, task: str) -> bool:
    try:
        with open(f"/proc/{pid}/task/{task}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # "tid (comm) S ...": the state follows the last ')' (a command may hold one)
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")
