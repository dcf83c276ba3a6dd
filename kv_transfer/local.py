"""Same-process transport: endpoints registered on an explicit `LocalHub` (tests, colocated mode)."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Sequence
from typing import Any

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer.base import KVTransport, Message, drain_inbox
from tandem.kv_transfer.manifest import TransferError


class LocalHub:
    """Where local endpoints find each other; pass the same hub to every endpoint."""

    def __init__(self, auth_token: str) -> None:
        self.auth_token = auth_token
        self._endpoints: dict[str, LocalTransport] = {}
        self._ids = itertools.count()

    def attach(self, endpoint: LocalTransport, token: str) -> str:
        if token != self.auth_token:
            raise TransferError("local transport: wrong cluster token")
        address = f"local:{next(self._ids)}"
        self._endpoints[address] = endpoint
        return address

    def detach(self, address: str) -> None:
        self._endpoints.pop(address, None)

    def gone(self, address: str) -> None:
        """Tells every endpoint that `address` closed (it sends, so writes, nothing more)."""
        for endpoint in self._endpoints.values():
            endpoint._inbox.put(Message(address, {"type": "peer_gone"}, None))

    def lookup(self, address: str) -> LocalTransport:
        try:
            return self._endpoints[address]
        except KeyError:
            raise TransferError(f"local transport: no endpoint at {address!r}") from None


class LocalTransport(KVTransport):
    """Copies pages synchronously into a staged tensor and queues the message on the peer."""

    name = "local"

    def __init__(self, auth_token: str, *, hub: LocalHub) -> None:
        super().__init__(auth_token)
        self.hub = hub
        self._address = hub.attach(self, auth_token)
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._pool: KVCachePool | None = None
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def register_pool(self, pool: KVCachePool) -> None:
        self._pool = pool

    def send(self, peer: str, header: dict[str, Any], src_block_ids: Sequence[int] = ()) -> None:
        if self._closed:
            raise TransferError("transport is closed")
        pages = None
        if src_block_ids:
            if self._pool is None:
                raise TransferError("register_pool() before sending pages")
            pages = self._pool.export_blocks(src_block_ids)
        self.deliver(peer, Message(self._address, dict(header), pages))

    def deliver(self, peer: str, message: Message) -> None:
        """Puts a message in the peer's inbox (the seam the fake transport overrides)."""
        self.hub.lookup(peer)._inbox.put(message)

    def poll(self, timeout: float = 0.0) -> list[Message]:
        return drain_inbox(self._inbox, timeout)

    def cancel(self, request_id: str) -> int:
        return 0  # sends are synchronous: nothing is ever queued on this side

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.hub.detach(self._address)
            self.hub.gone(self._address)
