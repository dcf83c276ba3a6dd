"""The transport contract: JSON headers plus KV pages between authenticated endpoints.

A transport only moves bytes; the protocol (reservations, chunks, acks, cancel, leases) lives in
`tandem.kv_transfer.sender` / `receiver` and is the same over every transport.

Semantics every implementation keeps:
- `send` is non-blocking and FIFO per peer: messages to one peer arrive in the order sent.
- The pages of `src_block_ids` are read from the registered pool when the message is actually
  sent; the caller keeps those blocks pinned until the peer acknowledges them.
- A received message carries the pages as a tensor `(n, layers, 2, block_size, kv_heads,
  head_dim)` (`Message.pages`), or, for transports that write straight into the receiver's pool
  (`Message.pages is None` and `header["direct"] is True`), they already sit at
  `header["manifest"]["dst_block_ids"]`.
- Every connection starts with the cluster token; a peer that does not present it is refused
  and can neither write pages nor send headers. Headers are JSON: nothing received is unpickled.
- Send failures come back through the *sender's own* `poll()`, since `send` does not wait: a
  `Message(peer, {"type": "transport_error", "peer": peer, "request_id": id or None, "error":
  text}, None)` per request whose queued messages were lost (wrong token, connection refused,
  peer died or closed, timeout); the peer's other queued messages are dropped with them.
  `request_id` is None when the link to `peer` broke with nothing queued (messages already
  handed over may or may not have arrived: the protocol's acks and leases decide).
- A transport that can tell that a peer's *process* is gone (not merely a broken link) may
  deliver `Message(peer, {"type": "peer_gone"}, None)` once every message of that peer's it
  will deliver has been delivered and nothing of the peer's can still be written into the pool:
  the receiver then frees what it held for that sender at once (`receiver.py`). shm, torch and
  ucx do when the sender runs on the same machine (`_peer_process`), and local at `close()`.
"""

from __future__ import annotations

import contextlib
import json
import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from tandem.kernels.kv_cache import KVCachePool


class Message(NamedTuple):
    """One received message: who sent it (their address), its JSON header, and staged pages."""

    peer: str
    header: dict[str, Any]
    pages: torch.Tensor | None = None


def drain_inbox(inbox: queue.Queue[Message], timeout: float = 0.0) -> list[Message]:
    """Every message waiting in `inbox`, waiting up to `timeout` seconds for the first one
    (the `poll` of transports that fill an inbox from another thread)."""
    out: list[Message] = []
    with contextlib.suppress(queue.Empty):
        out.append(inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait())
        while True:
            out.append(inbox.get_nowait())
    return out


class EncodedHeader(dict[str, Any]):
    """A header that comes with its JSON text, written by a caller on a hot path (the prefill
    engine's thread, `PagesHeaderWriter`). Transports that send JSON send `text` instead of
    encoding the dict again, and need not copy it: it is not changed after `send`.

    `text` may be given as a function of the header, called on first use: a transport that
    sends the header another way never pays for it. `plain_chunk_layout` is the layout's JSON
    text when the header is a chunk of pages other than a request's last, with no checksum (the
    writer sets it): its manifest's request id, chunk index, token count and block ids say all
    of it, which the shm and ucx transports' pull paths send as a compact record
    (`_chunk_records`)."""

    __slots__ = ("_text", "_write_text", "plain_chunk_layout")

    def __init__(
        self,
        header: dict[str, Any],
        text: str | Callable[[EncodedHeader], str],
        plain_chunk_layout: str | None = None,
    ) -> None:
        super().__init__(header)
        if isinstance(text, str):
            self._text: str | None = text
            self._write_text: Callable[[EncodedHeader], str] | None = None
        else:
            self._text, self._write_text = None, text
        self.plain_chunk_layout = plain_chunk_layout

    @property
    def text(self) -> str:
        if self._text is None:
            assert self._write_text is not None
            self._text = self._write_text(self)
        return self._text


def header_json(header: dict[str, Any]) -> str:
    """The JSON text of a header to send (an `EncodedHeader`'s own)."""
    if isinstance(header, EncodedHeader):
        return header.text
    return json.dumps(header, separators=(",", ":"))


class KVTransport(ABC):
    """Moves headers and KV pages between endpoints; one instance per process and role."""

    name: ClassVar[str]

    def __init__(self, auth_token: str) -> None:
        if not auth_token:
            raise ValueError("a KV transport needs a non-empty cluster auth token")
        self.auth_token = auth_token

    @property
    @abstractmethod
    def address(self) -> str:
        """How peers reach this endpoint (transport-specific string, safe to pass around)."""

    @abstractmethod
    def register_pool(self, pool: KVCachePool) -> None:
        """The KV pool pages are read from when sending (and written to, for direct transports)."""

    @abstractmethod
    def send(self, peer: str, header: dict[str, Any], src_block_ids: Sequence[int] = ()) -> None:
        """Queues `header` and the pages of `src_block_ids` for `peer` (non-blocking, FIFO)."""

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> list[Message]:
        """Messages received since the last call; waits up to `timeout` seconds for the first."""

    @abstractmethod
    def cancel(self, request_id: str) -> int:
        """Drops queued, not yet sent messages whose header names `request_id`; returns how many."""

    @abstractmethod
    def close(self) -> None:
        """Stops background work and releases connections and memory; idempotent."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
