"""The sampler's short path: a row's distribution over its most likely tokens only.

A row with a top-k of at most `CANDIDATES`, or a top-p whose nucleus (or a min-p whose
kept tokens) lies among its `CANDIDATES` most likely tokens (as a trained model's does: Qwen's
default top_k 20 and top_p 0.95, Llama's top_p 0.9), keeps no token outside them. Its distribution is then built over
those candidates alone: one `topk` over the vocabulary (and one log-sum-exp for a row without
top-k, to know the mass outside), where the whole-vocabulary path (`sampler._filtered`) makes
several passes over it and `draw` a cumulative sum of it. The same tokens are kept, with the
same probabilities up to rounding (`tests/unit/test_sampling_candidates.py`). It runs on the
logits' device without waiting for it (no value leaves it): on a GPU worker only the
candidates cross to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.request import Request

CANDIDATES = 256
"""The most likely tokens a row is looked at among (and `_apply_top_p`'s first look)."""


@dataclass
class Candidates:
    """For rows `rows` (indices into the rows given), whether their kept tokens all lie among
    their candidates (`fits`), and the candidates' token ids (ascending) and probabilities
    (zero for the candidates a row drops). Tensors on the logits' device."""

    rows: list[int]
    fits: torch.Tensor
    ids: torch.Tensor
    probs: torch.Tensor


def candidate_probabilities(scaled: torch.Tensor, requests: Sequence[Request]) -> Candidates:
    """The rows of `scaled` (logits over temperature, none +inf or NaN; row i belongs to
    requests[i]) whose kept tokens may all lie among their `CANDIDATES` most likely: those with
    a top-k of at most `CANDIDATES` (ties at the k-th included), or without top-k and with a
    top-p or a min-p (whose nucleus, or whose tokens above the floor, `fits` says are there).
    The others, and those that do not fit, take the whole-vocabulary path. The filters apply
    in the long path's order: min-p, top-k, top-p."""
    vocab, device = scaled.shape[-1], scaled.device
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in requests]
    maybe = [
        i
        for i, r in enumerate(requests)
        if 0 < ks[i] <= CANDIDATES or (ks[i] == 0 and (r.params.top_p < 1.0 or r.params.min_p > 0))
    ]
    if not maybe:
        none = torch.empty(0, 0, device=device)
        return Candidates([], torch.empty(0, dtype=torch.bool, device=device), none.long(), none)
    rows = scaled
    if len(maybe) < len(scaled):
        rows = scaled.index_select(0, torch.tensor(maybe, device=device))
    with_k = [ks[i] for i in maybe]
    # One past the widest k (to see whether the k-th value's ties go on), and CANDIDATES for
    # rows without top-k.
    width = min(vocab, max(CANDIDATES if 0 in with_k else 0, max(with_k) + 1))
    values, ids = rows.topk(width, dim=-1)  # descending
    fits = torch.ones(len(maybe), dtype=torch.bool, device=device)
    k_rows = [j for j, k in enumerate(with_k) if k]
    if k_rows:  # top-k: keep values >= the k-th; ties past the candidates do not fit
        index = torch.tensor(k_rows, device=device)
        last = torch.tensor([with_k[j] - 1 for j in k_rows], device=device)
        kept = values[index]
        kth = kept.gather(1, last[:, None])
        kept = kept.masked_fill(kept < kth, float("-inf"))
        values.index_put_((index,), kept)
        ties_beyond = (kept[:, -1] >= kth[:, 0]) & (width < vocab)
        fits.index_put_((index,), fits[index] & ~ties_beyond & torch.isfinite(kth[:, 0]))
    min_ps = [requests[i].params.min_p for i in maybe]
    p_rows = [j for j, p in enumerate(min_ps) if p > 0]
    if p_rows:  # min-p: drop what is less likely than min_p times the most likely token, i.e.
        # a logit under the largest one plus log(min_p); past the candidates only where the
        # last candidate is still kept (for a row without top-k: then it does not fit)
        index = torch.tensor(p_rows, device=device)
        kept = values[index]
        floor = kept[:, :1] + torch.tensor([[math.log(min_ps[j])] for j in p_rows], device=device)
        kept = kept.masked_fill(kept < floor, float("-inf"))
        values.index_put_((index,), kept)
        reaches_past = (kept[:, -1] >= floor[:, 0]) & (width < vocab)
        no_k = torch.tensor([with_k[j] == 0 for j in p_rows], device=device)
        fits.index_put_((index,), fits[index] & ~(reaches_past & no_k))
    top_ps = torch.tensor([requests[i].params.top_p for i in maybe], device=device)
    probs = values.softmax(dim=-1)
    # A row with neither top-k nor min-p: its distribution is over the whole vocabulary.
    no_k_rows = [j for j, k in enumerate(with_k) if k == 0 and min_ps[j] <= 0]
    if no_k_rows:
        index = torch.tensor(no_k_rows, device=device)
        whole_rows = rows if len(no_k_rows) == len(maybe) else rows[index]  # (no copy: all)
        whole = torch.logsumexp(whole_rows, dim=-1, keepdim=True)
        of_whole = (values[index] - whole).exp()
        probs.index_put_((index,), of_whole)
        among = of_whole.sum(dim=-1) >= top_ps[index]  # the nucleus is among them
        fits.index_put_((index,), fits[index] & among)
    outside = (1.0 - probs.sum(dim=-1)).clamp_(min=0.0)
    drop = nucleus_drop(probs.flip(-1), top_ps, outside) & (top_ps < 1.0)[:, None]
    values = values.masked_fill(drop.flip(-1), float("-inf"))
    probs = values.softmax(dim=-1)
    ids, order = ids.sort(dim=-1)  # (ascending ids: `draw` sums them as the long path does)
    return Candidates(maybe, fits, ids, probs.gather(1, order))


def nucleus_drop(
    ascending: torch.Tensor, top_ps: torch.Tensor, outside: torch.Tensor | None = None
) -> torch.Tensor:
    """Which tokens top-p drops from rows of probabilities in ascending order (the mass
    `outside` them, where given, counted first): each while the mass up to it stays at most
    1 - top_p; the most likely (the last) never (transformers' TopPLogitsWarper's rule)."""
    mass = ascending.cumsum(dim=-1)
    if outside is not None:
        mass = outside[:, None] + mass
    drop = mass <= (1 - top_ps[:, None])
    return torch.cat([drop[:, :-1], torch.zeros_like(drop[:, -1:])], dim=1)
