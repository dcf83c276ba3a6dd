"""What `KVReceiver` keeps per request: a live reservation, and the blocks of an ended one
that a sender might still be writing into (held until it confirms or the stall timeout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tandem.engine.sampling_params import SamplingParams


class ReservationGrant(NamedTuple):
    """What the prefill side needs: where to send, which blocks, and which it may skip."""

    request_id: str
    address: str
    dst_block_ids: list[int]
    num_hit_blocks: int
    lease_s: float


@dataclass
class Held:
    """Blocks of an ended reservation a sender might still be writing into."""

    request_id: str
    peer: str | None
    block_table: list[int]
    deadline: float
    cancel_reason: str | None = None  # ended by a decode-side cancel (else by a failure)
    num_hit_blocks: int = 0  # (cached blocks at the table's start: no sender writes them)

    @classmethod
    def of(cls, res: Reservation, deadline: float, cancel_reason: str | None) -> Held:
        return cls(
            res.request_id, res.peer, res.block_table, deadline, cancel_reason, res.num_hit_blocks
        )

    @property
    def writable(self) -> list[int]:
        """The blocks its sender was asked to write."""
        return self.block_table[self.num_hit_blocks :]


@dataclass
class Reservation:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_table: list[int]
    block_hashes: list[int]  # the prompt's full blocks' (prefix-cache keys)
    num_hit_blocks: int
    deadline: float
    next_block: int
    next_chunk: int = 0
    peer: str | None = None
    matcher: Any = None  # a JSON-schema request's grammar, past the first tokens (checked)
    chunk_ends: list[int] = field(default_factory=list)  # `next_block` after each chunk

    def chunk_blocks(self, index: int) -> list[int]:
        """The blocks accepted chunk `index` wrote."""
        start = self.chunk_ends[index - 1] if index else self.num_hit_blocks
        return self.block_table[start : self.chunk_ends[index]]

    @property
    def writable(self) -> list[int]:
        """The blocks its sender was asked to write (not the cached ones at the start)."""
        return self.block_table[self.num_hit_blocks :]
