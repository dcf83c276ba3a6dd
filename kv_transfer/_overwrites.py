"""Pages a transport wrote into the pool that the protocol then refused.

shm, torch and ucx write a message's pages where its manifest's `dst_block_ids` say (`direct`)
before `KVReceiver` reads the manifest. A message it does not take (a refused chunk, a chunk for
an unknown reservation or from another sender, a duplicate that names other blocks) may thus
have written blocks it had no right to: those of other requests, or cached prefixes. Nothing may
read them as they are: every request holding such a block fails, and the block leaves the
prefix cache (`KVReceiver._overwritten`)."""

from __future__ import annotations

from collections.abc import Iterable

from tandem.kv_transfer._socket_channel import dst_block_ids_of
from tandem.kv_transfer.base import Message


def direct_destinations(message: Message, num_blocks: int) -> set[int]:
    """The pool blocks the transport wrote `message`'s pages into (empty: its pages were
    staged, or it carried none)."""
    if message.pages is not None or message.header.get("direct") is not True:
        return set()
    ids = dst_block_ids_of(message.header) or ()
    return {i for i in ids if 0 <= i < num_blocks}


def holders(blocks: set[int], tables: Iterable[tuple[str, list[int]]]) -> list[str]:
    """The ids whose block table (of `tables`: id, table) holds one of `blocks`."""
    return [owner for owner, table in tables if not blocks.isdisjoint(table)]
