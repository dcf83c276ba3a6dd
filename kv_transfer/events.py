"""What the transfer protocol reports to its owner (a worker loop or a test)."""

from __future__ import annotations

from typing import Literal, NamedTuple

from tandem.engine.outputs import TokenLogprob

EventKind = Literal["first_token", "sent", "committed", "finished_early", "failed", "cancelled"]


class TransferEvent(NamedTuple):
    """`first_token`: prefill sampled the first token(s) (`token_ids`); `sent`: every chunk was
    acknowledged and the prefill side let go of the pages; `committed`: the request runs in the
    decode engine; `finished_early`: the first token already ended the request; `failed` /
    `cancelled`: the transfer ended without a commit and every block was released.
    `logprobs`: of `token_ids`, when the request asks for them (`first_token`, `committed`,
    `finished_early`). `code`: why a `failed` transfer failed, where its owner acts on it
    (`SENDER_GONE`: the sender's process ended mid-transfer)."""

    kind: EventKind
    request_id: str
    token_ids: tuple[int, ...] = ()
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    code: str | None = None


SENDER_GONE = "sender_gone"
"""The `code` of a transfer that failed because its sender's process ended (the transport's
``peer_gone``): the request may start over on another prefill worker."""
