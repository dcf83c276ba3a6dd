"""Log-probabilities of sampled tokens, for requests that ask (`SamplingParams.logprobs`).

They are of the model's own distribution: the log-softmax of its fp32 logits before temperature,
top-k, top-p or `min_tokens` change them (vLLM's default, "raw" logprobs). The rows are copied
before sampling, which changes `min_tokens` rows in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tandem.engine.outputs import TokenLogprob
from tandem.engine.request import Request

if TYPE_CHECKING:
    from tandem.engine.model_runner import PromptSpan

LOGPROB_FLOOR = -9999.0


def rows_wanting_logprobs(requests: Sequence[Request], rows: Sequence[int]) -> list[int]:
    """Those of `rows` whose requests ask for logprobs."""
    return [i for i in rows if requests[i].params.logprobs is not None]


def raw_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """A copy of `rows` of `logits` (None for none), taken before sampling."""
    if not rows:
        return None
    return logits.index_select(0, torch.tensor(rows))


def token_logprobs(
    raw: torch.Tensor, tokens: Sequence[int], top_counts: Sequence[int]
) -> list[TokenLogprob]:
    """For row i of `raw` (fp32 logits): the log-probability of `tokens[i]` and the
    `top_counts[i]` most likely tokens with theirs, most likely first."""
    # (clamped as vLLM does: -inf, for a masked-out logit, is not JSON)
    logprobs = torch.log_softmax(raw.float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(1, torch.tensor(list(tokens))[:, None]).squeeze(1).tolist()
    k = max(top_counts)
    if k == 0:
        return [(lp, []) for lp in chosen]
    top_values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        (lp, list(zip(ids[i][:count], values[i][:count], strict=True)))
        for i, (lp, count) in enumerate(zip(chosen, top_counts, strict=True))
    ]


def add_prompt_logprobs(logits: torch.Tensor, spans: Sequence[PromptSpan]) -> None:
    """Fills each span's prompt logprobs from its rows of the step's `logits`: position p's
    row gives prompt token p + 1's logprob, alternatives and rank (kept from the first time
    it was computed)."""
    for span in spans:
        req = span.request
        assert req.prompt_logprobs is not None
        rows = logits[span.row : span.row + span.length]
        nxt = req.prompt_token_ids[span.start + 1 : span.start + 1 + span.length]
        k = req.params.prompt_logprobs or 0
        entries = token_logprobs(rows, nxt, [k] * span.length)
        ranks = token_ranks(rows, nxt)
        for offset, (entry, rank) in enumerate(zip(entries, ranks, strict=True), span.start + 1):
            if req.prompt_logprobs[offset] is None:
                req.prompt_logprobs[offset] = (entry[0], entry[1], rank)


def token_ranks(raw: torch.Tensor, tokens: Sequence[int]) -> list[int]:
    """Row i's rank of `tokens[i]`: how many tokens are at least as likely (itself included)."""
    rows = raw.float()
    chosen = rows.gather(1, torch.tensor(list(tokens))[:, None])
    return (rows >= chosen).sum(dim=1).tolist()


def parse_entries(value: object, count: int, top: int) -> list[TokenLogprob] | None:
    """`count` entries as JSON gave them (`[lp, [[id, lp], ...]]` each, at most `top`
    alternatives), or None when `value` is not that."""
    if not isinstance(value, list) or len(value) != count:
        return None
    entries: list[TokenLogprob] = []
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_number(entry[0])):
            return None
        alternatives = entry[1]
        if not isinstance(alternatives, list) or len(alternatives) > top:
            return None
        pairs = []
        for pair in alternatives:
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and type(pair[0]) is int
                and _is_number(pair[1])
            ):
                return None
            pairs.append((pair[0], float(pair[1])))
        entries.append((float(entry[0]), pairs))
    return entries


def _is_number(value: object) -> bool:
    return type(value) in (int, float)
