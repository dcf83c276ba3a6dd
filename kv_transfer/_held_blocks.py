"""What `KVReceiver` holds after a reservation ended: blocks a sender might still be writing
into, each until its sender confirms it stopped, is known gone, or the stall timeout passes (see
`receiver.py`), and the senders the transport reported gone."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tandem.kv_transfer._receiver_records import Held

GONE_KEPT = 256
"""How many gone senders are remembered (for `release_from_lost_sender` calls that come after
the transport's word)."""


class HeldBlocks:
    """The held entries (iterable, oldest first); `free` returns a block table to the engine."""

    def __init__(self, free: Callable[[list[int]], None]) -> None:
        self._free = free
        self._entries: list[Held] = []
        self.gone: dict[str, None] = {}
        """Senders the transport reported gone (``peer_gone``), oldest first (`GONE_KEPT`)."""

    def __iter__(self) -> Iterator[Held]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, held: Held) -> None:
        self._entries.append(held)

    def release(self, which: Callable[[Held], bool]) -> list[Held]:
        """Frees the entries `which` picks; returns them."""
        released = [h for h in self._entries if which(h)]
        for held in released:
            self._entries.remove(held)
            self._free(held.block_table)
        return released

    def stopped(self, request_id: str, peer: str) -> None:
        """`peer` confirmed it stopped sending `request_id` (nothing more is in flight)."""
        self.release(lambda h: h.request_id == request_id and h.peer in (None, peer))

    def expired(self, now: float) -> None:
        self.release(lambda h: now > h.deadline)

    def unwritten(self, request_id: str) -> int:
        """No sender was given `request_id`'s grant: its entries no page reached go back.
        Returns how many blocks."""
        return _blocks(self.release(lambda h: h.request_id == request_id and h.peer is None))

    def from_lost_sender(self, request_id: str, sender: str) -> int:
        """`request_id`'s grant went to `sender` (lost by the router): its entries no page
        reached are that sender's, and go back now if it is gone. Returns how many blocks."""
        for held in self._entries:
            if held.request_id == request_id and held.peer is None:
                held.peer = sender
        if sender not in self.gone:
            return 0
        return _blocks(self.release(lambda h: h.request_id == request_id and h.peer == sender))

    def sender_gone(self, peer: str) -> list[Held]:
        """`peer`'s process ended: its entries go back (returned)."""
        self.gone[peer] = None
        while len(self.gone) > GONE_KEPT:
            del self.gone[next(iter(self.gone))]
        return self.release(lambda h: h.peer == peer)

    def writable(self, request_id: str, peer: str) -> set[int]:
        """The blocks `peer` may still be writing for `request_id` (its held entries')."""
        return {
            b
            for h in self._entries
            if h.request_id == request_id and h.peer in (None, peer)
            for b in h.writable
        }

    def cancel_reason(self, request_id: str, peer: str) -> str | None:
        """Why `request_id` was cancelled here, if it was and `peer` may be its sender."""
        for held in self._entries:
            if held.request_id == request_id and held.peer in (None, peer):
                return held.cancel_reason
        return None


def _blocks(released: list[Held]) -> int:
    return sum(len(h.block_table) for h in released)
