"""Two-process checks of what a transport reports when the process at the other end dies
(the receiver's ``peer_gone``, the sender's ``transport_error``), over `transport_harness`."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from tandem.kv_transfer.base import KVTransport, Message
from tests.transport_harness import PeerProcess, _errors, collect, make_endpoint, manifest_header


def check_peer_death(name: str) -> None:
    """When the receiving process is killed, the sender's poll() reports a transport_error, and
    a later send to it reports one naming that send's request."""
    peer = PeerProcess()
    sender, _ = make_endpoint(name)
    try:
        address, _ = peer.create(name)
        sender.send(address, manifest_header("first", [3]), [1])
        assert [r.header["request_id"] for r in peer.receive(1)] == ["first"]
        peer.kill()
        if address.startswith("shm:"):  # a killed endpoint cannot remove its socket file
            with contextlib.suppress(OSError):
                os.unlink(address.removeprefix("shm:"))
        errors = _first_error(sender, 10.0)  # (a ``peer_gone`` may come first: the sender
        assert errors and errors[0]["peer"] == address and errors[0]["error"]  # hears it too)
        sender.send(address, manifest_header("after", [4]), [2])
        later = _errors(collect(sender, 1, 10.0))
        assert [e["request_id"] for e in later] == ["after"]
        assert getattr(sender, "errors", [None])
    finally:
        sender.close()
        peer.stop()


def _first_error(transport: KVTransport, timeout: float) -> list[dict[str, Any]]:
    """The transport_errors of the messages up to the first of them (none in `timeout`: [])."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if errors := _errors(collect(transport, 1, deadline - time.monotonic())):
            return errors
    return []


def _until_gone(receiver: KVTransport, timeout: float) -> list[tuple[str, str]]:
    """(peer, request id or "peer_gone") of the messages up to the first ``peer_gone`` (not
    the receiver's own link's errors: ucx links back to a sender for its welcome)."""
    got: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while not got or got[-1][1] != "peer_gone":
        assert time.monotonic() < deadline, f"no peer_gone in {timeout} s: {got}"
        for m in receiver.poll(0.05):
            if m.header.get("type") != "transport_error":
                got.append((m.peer, m.header.get("type") or m.header["request_id"]))
    return got


def _gone(messages: list[Message]) -> list[str]:
    return [m.peer for m in messages if m.header.get("type") == "peer_gone"]


def check_sender_death_reported(
    name: str, *, shm_pool: bool = False, options: dict[str, Any] | None = None
) -> None:
    """The receiver learns that the sending process ended: a ``peer_gone`` message follows
    everything the sender sent, once (so decode frees what it held for it)."""
    receiver, _ = make_endpoint(name, shm_pool=shm_pool, options=options)
    sender = PeerProcess()
    try:
        address, _ = sender.create(name, shm_pool=shm_pool, options=options)
        sender.send(receiver.address, manifest_header("before", [3]), [1])
        assert [m.header["request_id"] for m in collect(receiver, 1, 10.0)] == ["before"]
        sender.send(receiver.address, manifest_header("maybe", [4]), [2])
        sender.kill()  # ("maybe" may or may not have gone out)
        got = _until_gone(receiver, 10.0)
        assert got in (
            [(address, "peer_gone")],
            [(address, "maybe"), (address, "peer_gone")],
        ), got
        assert _gone(collect(receiver, 1, 0.5)) == []
    finally:
        sender.stop()
        receiver.close()


def check_closed_sender_not_reported_gone(
    name: str, monkeypatch: Any, *, shm_pool: bool = False
) -> None:
    """A sender's connection ends but its process lives (it could connect again): no
    ``peer_gone``."""
    monkeypatch.setattr("tandem.kv_transfer._channel_transport.SENDER_EXIT_WAIT_S", 0.3)
    receiver, _ = make_endpoint(name, shm_pool=shm_pool)
    sender = PeerProcess()
    try:
        sender.create(name, shm_pool=shm_pool)
        sender.send(receiver.address, manifest_header("before", [3]), [1])
        assert [m.header["request_id"] for m in collect(receiver, 1, 10.0)] == ["before"]
        sender.close_endpoint()
        assert _gone(collect(receiver, 1, 1.5)) == []
    finally:
        sender.stop()
        receiver.close()
