"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens.

Greedy rows are an argmax over the batch. Other rows are sampled one by one when they carry a
seed (their own `torch.Generator`, so their tokens do not depend on what else is in the batch)
and together otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.request import Request


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One token per row of `logits` (fp32, (B, vocab)); row i belongs to requests[i]."""
    _suppress_stops_before_min_tokens(logits, requests)
    if all(r.params.greedy for r in requests):
        greedy: list[int] = logits.argmax(dim=-1).tolist()
        return greedy
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    batch_rows = [i for i, r in enumerate(requests) if not r.params.greedy and r.generator is None]
    if batch_rows:
        rows = torch.tensor(batch_rows)
        probs = _probabilities(logits.index_select(0, rows), [requests[i] for i in batch_rows])
        picked = torch.multinomial(probs, 1).squeeze(1).tolist()
        for i, tok in zip(batch_rows, picked, strict=True):
            tokens[i] = tok
    for i, req in enumerate(requests):
        if req.generator is not None:
            probs = _probabilities(logits[i : i + 1], [req])
            tokens[i] = int(torch.multinomial(probs, 1, generator=req.generator).item())
    return tokens


def _probabilities(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    top_ks = [r.params.top_k for r in requests]
    if any(k > 0 for k in top_ks):
        scaled = _apply_top_k(scaled, top_ks)
    top_ps = [r.params.top_p for r in requests]
    if any(p < 1.0 for p in top_ps):
        scaled = _apply_top_p(scaled, torch.tensor(top_ps, dtype=logits.dtype))
    return torch.softmax(scaled, dim=-1)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (ks - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_ps[:, None])
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _suppress_stops_before_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    for i, req in enumerate(requests):
        if req.params.min_tokens and req.num_output_tokens < req.params.min_tokens and req.stop_ids:
            ids = [t for t in req.stop_ids if t < logits.shape[-1]]
            logits[i, ids] = float("-inf")
