"""Doorbells: how a UCX endpoint on this machine wakes another's polling thread (`ucx.py`).

UCX's own way to sleep until a message comes (its WAKEUP feature) halves its shared-memory
throughput here, so each endpoint's thread polls. A decode worker's thread that polls while it
waits for a prefill's next chunk takes a core from that prefill on a small host, and one that
polls slowly sees the request's last chunk (its commit) late. So an endpoint also binds a
datagram socket in the abstract namespace, named after its UCX address (`bell_name`): a sender
on the same machine rings it after each frame it sends, and the receiving thread, while every
sender it hears from rings, sleeps on that socket instead of polling. A ring costs the sender
one system call. Abstract names are local to a network namespace: a peer elsewhere cannot ring,
and a ring to it fails at once, which the sender ignores (the receiver polls for such peers).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

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
        except OSError:  # (no abstract namespace here: the thread polls, nobody rings it)
            self._sock.close()
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            self.bound = False
        else:
            self.bound = True

    def ring(self, name: bytes) -> None:
        """Wakes the thread of the endpoint whose bell is `name`, if it is on this machine
        (a bell whose queue is full has been rung already; a missing one cannot be)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.sendto(b"!", name)

    def wake(self) -> None:
        """Cuts this endpoint's own `wait` short (from another thread of this process)."""
        if self.bound:
            self.ring(self.name)
        else:
            self._event.set()

    def wait(self, timeout: float) -> None:
        """Sleeps until the bell rings or `timeout` seconds pass; clears the rings."""
        sock = self._sock
        if sock is None or not self.bound:
            self._event.wait(timeout)
            self._event.clear()
            return
        with contextlib.suppress(OSError, ValueError):
            if select.select([sock], [], [], timeout)[0]:
                with contextlib.suppress(BlockingIOError):
                    while True:
                        sock.recv(16)

    def close(self) -> None:
        self._event.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
