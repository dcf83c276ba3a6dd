"""What `KVSender` keeps per request it streams, and what its engine's thread queues for the
publishing thread."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.receiver import ReservationGrant


@dataclass
class Outgoing:
    request: Request
    params: SamplingParams  # the request's own; the prefill engine runs it with max_tokens=1
    grant: ReservationGrant | None  # None until `attach_grant`
    next_block: int
    next_chunk: int = 0
    unacked: dict[int, list[int]] = field(default_factory=dict)  # chunk index -> pinned blocks
    last_sent: bool = False
    finished: bool = False
    cancelling: bool = False
    failure: str | None = None  # set by `fail`: the request ends "failed" with this error
    deadline: float = math.inf


Pinned = tuple[Outgoing, int, list[int], bool]
"""Blocks the engine's thread pinned for a chunk: (request, index of the first block in its
block table, the blocks, whether it is the last chunk). The rest of the chunk is made where it
is sent (`_take`). A plain tuple: a named one costs a Python call on the engine's thread."""
