"""What a socket-based transport fills in (`ChannelTransport` runs the machinery around it):
where it listens and how it connects, what the handshake adds, how pages move with a message
and what a link or connection holds. See `_channel_transport` for which thread runs each."""

from __future__ import annotations

import socket
from typing import Any

from tandem.kv_transfer._socket_channel import Conn, FrameError, Link, Outgoing
from tandem.kv_transfer.base import KVTransport, Message


class ChannelHooks(KVTransport):
    """The hooks of `ChannelTransport` and their defaults (NotImplementedError: a subclass must
    fill it in)."""

    def _open_listener(self) -> tuple[socket.socket, str]:
        """A listening socket and the address peers use to reach it."""
        raise NotImplementedError

    def _connect(self, peer: str) -> socket.socket:
        """A connected socket to `peer`'s control listener."""
        raise NotImplementedError

    def _hello_extra(self) -> dict[str, Any]:
        return {}

    def _accept_hello(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        """Extra fields of the welcome frame for an authenticated peer."""
        return {}

    def _accepted(self, conn: Conn) -> None:
        """Runs after the welcome frame was sent (may block, e.g. to form a process group)."""

    def _connected(self, link: Link) -> None:
        """Runs after the welcome frame was received (may block)."""

    def _transmit(self, link: Link, item: Outgoing) -> bytes | None:
        """Moves `item`'s pages; returns its frame for the caller to send (frames of messages
        queued back to back go out in one write), or calls `_flush` and sends it itself and
        returns None. Raising fails the link."""
        raise NotImplementedError

    def _receive(self, conn: Conn, frame: dict[str, Any], header: dict[str, Any]) -> Message:
        """Turns a received `msg` frame into a `Message` (collecting its pages)."""
        raise NotImplementedError

    def _control_frame(self, conn: Conn, frame: dict[str, Any]) -> None:
        """A frame other than `msg` from an authenticated peer; raising ends the connection."""
        raise FrameError(f"unexpected frame {frame.get('type')!r}")

    def _back_frame(self, link: Link, frame: dict[str, Any]) -> None:
        raise FrameError(f"unexpected frame {frame.get('type')!r} from {link.peer}")

    def _release_link(self, link: Link) -> None:
        """Drops what a link holds (mappings, groups); never raises."""

    def _release_conn(self, conn: Conn) -> None:
        """Drops what an accepted connection holds; never raises."""

    def _release(self) -> None:
        """Frees endpoint-wide resources at close (after threads were stopped)."""
