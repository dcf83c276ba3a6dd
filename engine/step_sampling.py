"""One step's tokens from its logits, and the raw logits of the rows that want logprobs.

Penalties, logit biases, grammars and logprobs are worked out on the host, so the rows of the
requests that have any of them (`Request.sampling_extras`) cross to it. On a GPU only those rows
do: the others are sampled where the logits are (`sampler.sample`), so one request asking for
logprobs does not copy a vocabulary-wide row of every request in its batch (39 MB at 152k x 64)
to the host each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tandem.engine.logprobs import raw_rows, rows_wanting_logprobs
from tandem.engine.request import Request
from tandem.engine.sampler import NO_TOKEN, rows_of, sample


class StepTokens(NamedTuple):
    tokens: list[int]  # one a row (`sampler.NO_TOKEN` where a request allows none)
    raw: torch.Tensor | None  # on the host: the logits of `logprob_rows`, before sampling
    logprob_rows: list[int]


def sample_step(
    logits: torch.Tensor,
    requests: Sequence[Request],
    extra_rows: Sequence[int],
    *,
    split: bool | None = None,
) -> StepTokens:
    """Row i of `logits` (fp32, (B, vocab), on any device; changed in place) is `requests[i]`'s;
    `extra_rows` are those with `sampling_extras`. `split` (default: when the logits are not
    on the host) samples the extra rows on the host apart from the others, which stay on the
    logits' device; else the whole batch is sampled on the host."""
    if not extra_rows:
        return StepTokens(sample(logits, requests), None, [])
    if split is None:
        split = logits.device.type != "cpu"
    apart = split and len(extra_rows) < len(requests)
    on_host = list(extra_rows) if apart else list(range(len(requests)))
    host = rows_of(logits, on_host).cpu()
    host_requests = [requests[i] for i in on_host]
    host_extra = range(len(on_host)) if apart else extra_rows  # (indices into `host`)
    wanting = rows_wanting_logprobs(host_requests, host_extra)
    raw = raw_rows(host, wanting)  # (before `sample` changes the rows)
    tokens = [NO_TOKEN] * len(requests)
    for i, token in zip(on_host, sample(host, host_requests, host_extra), strict=True):
        tokens[i] = token
    if apart:
        taken = set(extra_rows)
        plain = [i for i in range(len(requests)) if i not in taken]
        plain_tokens = sample(rows_of(logits, plain), [requests[i] for i in plain])
        for i, token in zip(plain, plain_tokens, strict=True):
            tokens[i] = token
    return StepTokens(tokens, raw, [on_host[j] for j in wanting])
