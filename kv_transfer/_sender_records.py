"""What `KVSender` keeps per request it streams (and whether its first token ends it), what
its engine's thread queues for the publishing thread, and the full header of a chunk."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.engine.output_text import OutputText
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.kv_transfer.base import EncodedHeader
from tandem.kv_transfer.manifest import PagesHeaderWriter, encode_state
from tandem.kv_transfer.receiver import ReservationGrant

ENDED_UNGRANTED_KEPT = 4096
"""Requests a sender remembers as ended before their reservation came (a late grant for one is
refused, and its decode worker told)."""


class UnknownRequest(KeyError):
    """A grant for a request a sender has not started (nor recently ended)."""


def check_grant(grant: ReservationGrant, num_prompt_tokens: int, block_size: int) -> None:
    """ValueError unless the reservation has a block for each of the prompt's uncached ones."""
    expected = math.ceil(num_prompt_tokens / block_size) - grant.num_hit_blocks
    if len(grant.dst_block_ids) != expected:
        raise ValueError(
            f"reservation has {len(grant.dst_block_ids)} blocks, prompt needs {expected}"
        )


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
    told_at: float = 0.0  # when its decode worker last heard of it (a chunk, a renewal)
    fills_context: bool = False  # the prompt and its first token reach max_model_len

    def lease_ends_soon(self, now: float) -> bool:
        """Streaming to a reservation that has heard nothing of it for a third of its lease
        (the request waits its turn, or computes between chunks): time to renew it."""
        grant = self.grant
        return (
            grant is not None
            and not self.last_sent
            and not self.cancelling
            and now - self.told_at > grant.lease_s / 3
        )

    def first_token_ends(self, tokenizer: Tokenizer) -> bool:
        """The sampled first token already finishes the request: end of sequence, one token
        asked for, the context full, or its text holds a stop string (the prefill engine runs
        without them)."""
        req, params = self.request, self.params
        if req.finish_reason == "stop" or params.max_tokens == 1 or self.fills_context:
            return True
        # (stop strings count after the first `min_tokens` tokens, as the engine counts them)
        if not params.stop or params.min_tokens > 0 or not req.output_token_ids:
            return False
        text = OutputText.after(
            tokenizer, req.prompt_token_ids, req.output_token_ids, params=params
        )
        return text.find_stop(params.stop) is not None  # (also in text a byte run holds)


Pinned = tuple[Outgoing, int, list[int], bool]
"""Blocks the engine's thread pinned for a chunk: (request, index of the first block in its
block table, the blocks, whether it is the last chunk). The rest of the chunk is made where it
is sent (`_take`). A plain tuple: a named one costs a Python call on the engine's thread."""


def full_header(
    headers: PagesHeaderWriter,
    out: Outgoing,
    index: int,
    num_tokens: int,
    blocks: list[int],
    dst: list[int],
    *,
    last: bool,
    checksum: str | None,
    tokenizer: Tokenizer,
) -> EncodedHeader:
    """A chunk's full header (with a checksum, or the request's last chunk, which carries the
    first token, its logprobs, the sampler state and whether the token ends the request)."""
    req = out.request if last else None
    return headers.write(
        out.request.request_id,
        index,
        last=last,
        num_tokens=num_tokens,
        src_block_ids=blocks,
        dst_block_ids=dst,
        checksum=checksum,
        first_token_ids=req.output_token_ids if req is not None else (),
        sampler_state=encode_state(req.generator.get_state())
        if req is not None and req.generator
        else None,
        finished=out.first_token_ends(tokenizer) if last else None,
        first_token_logprobs=req.logprobs if req is not None else None,
    )
