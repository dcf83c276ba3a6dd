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
from tandem.engine.sampler import sample


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
    on the host and the batch mixes both kinds) samples the extra rows on the host apart from
    the others, which stay on the logits' device."""
    if not extra_rows:
        return StepTokens(sample(logits, requests), None, [])
    mixed = len(extra_rows) < len(requests)
    if split is None:
        split = mixed and logits.device.type != "cpu"
    if not (split and mixed):
        host = logits.cpu()
        rows = rows_wanting_logprobs(requests, extra_rows)
        raw = raw_rows(host, rows)  # (before `sample` changes the rows)
        return StepTokens(sample(host, requests, extra_rows), raw, rows)
    extras = [requests[i] for i in extra_rows]
    host = _rows(logits, extra_rows).cpu()
    wanting = rows_wanting_logprobs(extras, range(len(extras)))
    raw = raw_rows(host, wanting)  # (before `sample` changes the rows)
    tokens = [0] * len(requests)
    for i, token in zip(extra_rows, sample(host, extras, range(len(extras))), strict=True):
        tokens[i] = token
    plain = sorted(set(range(len(requests))) - set(extra_rows))
    plain_tokens = sample(_rows(logits, plain), [requests[i] for i in plain])
    for i, token in zip(plain, plain_tokens, strict=True):
        tokens[i] = token
    return StepTokens(tokens, raw, [extra_rows[j] for j in wanting])


def _rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    return logits.index_select(0, torch.tensor(list(rows), device=logits.device))
