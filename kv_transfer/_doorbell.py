"""Doorbells: how a UCX endpoint on this machine wakes another's polling thread (`ucx.py`).

UCX's own way to sleep until a message comes (its WAKEUP feature) halves its shared-memory
throughput here, so each endpoint's thread polls. A decode worker's thread that polls while it
waits for a prefill's next chunk takes a core from that prefill on a small host, and one that
polls slowly sees the request's last chunk (its commit) late. So an endpoint also binds a
datagram socket in the abstract namespace, named after its UCX address (`bell_name`), and rings a
peer's bell from it after each frame it sends (one system call). A ring carries its bell's name
as the datagram's source, so a receiver knows which senders' rings reach it (`wait`), and its
thread sleeps on the bell instead of polling only while every sender it hears from is one of
them. Abstract names are local to a network namespace: a ring to a peer elsewhere fails at once
(ignored), and that peer, never heard, keeps its receiver polling.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Any

import xxhash


def bell_name(address: str) -> bytes:
    """The abstract socket name of the endpoint at `address` (a UCX worker address)."""
    return b"\0tandem-ucx-" + xxhash.xxh3_128_hexdigest(address.encode()).encode()


class Doorbell:
    """An endpoint's own bell (`wait`, `wake`) and its way to ring others (`ring`)."""

    def __init__(self, address: str) -> None:
        self.name = bell_name(address)
        self._event = threading.Event()  # (wakes `wait` where the socket could not be bound)
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        try:
            self._sock.bind(self.name)
        except OSError:  # (taken, or no abstract namespace: nobody rings it, its thread polls)
            self._sock.close()
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            self.bound = False
        else:
            self.bound = True

    def ring(self, name: bytes) -> None:
        """Wakes the thread of the endpoint whose bell is `name`, if it is on this machine
        (a bell whose queue is full has been rung already; a missing one cannot be)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.sendto(b"!", name)

    def wake(self) -> None:
        """Cuts this endpoint's own `wait` short (from another thread of this process)."""
        if self.bound:
            self.ring(self.name)
        else:
            self._event.set()

    def wait(self, timeout: float) -> set[bytes]:
        """Sleeps until the bell rings or `timeout` seconds pass; clears the rings. The names of
        the other bells that rang it (a ringer whose own bell is not bound goes unnamed)."""
        sock, rang = self._sock, set[Any]()
        if sock is None or not self.bound:
            self._event.wait(timeout)
            self._event.clear()
            return rang
        with contextlib.suppress(OSError, ValueError):
            if select.select([sock], [], [], timeout)[0]:
                with contextlib.suppress(BlockingIOError):
                    while True:
                        rang.add(sock.recvfrom(16)[1])
        rang.discard(self.name)
        return {name for name in rang if isinstance(name, bytes) and name}

    def close(self) -> None:
        self._event.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
