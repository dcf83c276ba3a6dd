"""What `KVReceiver` keeps per request: a live reservation, and the blocks of an ended one
that a sender might still be writing into (held until it confirms or the stall timeout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.sampling_params import SamplingParams


@dataclass
class Held:
    """Blocks of an ended reservation a sender might still be writing into."""

    request_id: str
    peer: str | None
    block_table: list[int]
    deadline: float
    cancel_reason: str | None = None  # ended by a decode-side cancel (else by a failure)


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
