"""Removes what shm endpoints whose process died left behind: control sockets and regions.

An endpoint removes its socket file and regions when it closes, at interpreter exit, and when a
multiprocessing child exits; a process killed with SIGKILL (Ray killing a worker, the OOM
killer) leaves its socket behind, and its regions too when its resource tracker dies with it.
They pile up in the temp directory and in /dev/shm (memory). A socket file is stale when
nothing listens on it: a connect is refused. A region is stale when no process holds the
shared `flock` its owner takes (`_shm_region`). Anything younger than `min_age_s` is left
alone: an endpoint binds its socket a moment before it listens on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import time
from collections.abc import Callable

from tandem.kv_transfer._shm_region import is_region_name

logger = logging.getLogger(__name__)

_SOCKET_RE = re.compile(r"^tandem-kv-[0-9a-f]{8,32}\.sock$")


def remove_stale_sockets(directory: str, min_age_s: float = 60.0) -> int:
    """Unlinks the shm endpoints' socket files in `directory` that nothing listens on and that
    are older than `min_age_s`; returns how many were removed. Never raises."""
    return _sweep(directory, _SOCKET_RE.match, _refused, min_age_s, "socket")


def _refused(path: str) -> bool:
    """Whether a connect to the Unix socket at `path` is refused (no process listens on it)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        code = probe.connect_ex(path)
    finally:
        with contextlib.suppress(OSError):
            probe.close()
    return code == errno.ECONNREFUSED


SHM_DIR = "/dev/shm"


def remove_stale_regions(directory: str = SHM_DIR, min_age_s: float = 60.0) -> int:
    """Unlinks the shm endpoints' regions in `directory` (POSIX shared memory) that no process
    holds and that are older than `min_age_s`; returns how many were removed. Never raises."""
    return _sweep(directory, is_region_name, lambda path: not _held(path), min_age_s, "region")


def _sweep(
    directory: str,
    ours: Callable[[str], object],
    stale: Callable[[str], bool],
    min_age_s: float,
    what: str,
) -> int:
    """Unlinks the files of `directory` named as `ours` that are older than `min_age_s` and
    `stale`; returns how many. Files another user owns, or gone meanwhile, are skipped."""
    removed = 0
    try:
        names = [name for name in os.listdir(directory) if ours(name)]
    except OSError:
        return 0
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            if now - os.lstat(path).st_mtime < min_age_s or not stale(path):
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    if removed:
        logger.info("removed %d stale KV transfer %s(s) from %s", removed, what, directory)
    return removed


def _held(path: str) -> bool:
    """Whether a process holds a lock on the file at `path` (its owner, alive)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
