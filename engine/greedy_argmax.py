"""Greedy decoding's row-wise argmax over wide fp32 logits, faster than `argmax` on the CPU."""

from __future__ import annotations

import torch

ARGMAX_GROUP = 32


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, same result as `logits.argmax(-1)` (first index among equal maxima).

    Two levels, because a plain argmax over a wide fp32 row is not vectorized on CPU: the max of
    each group of 32 columns (vectorized), the first group holding the row max, then the first
    max inside that group. Columns past the last full group are checked on their own.
    """
    rows, vocab = logits.shape
    groups = vocab // ARGMAX_GROUP
    if vocab < 4096 or logits.device.type != "cpu":  # (a GPU's argmax is fast as it is)
        return logits.argmax(dim=-1)
    if logits.t().is_contiguous() and rows > 1:  # vocab-major logits, as the model returns them
        return _greedy_argmax_vocab_major(logits.t())
    if not logits.is_contiguous():
        return logits.argmax(dim=-1)
    grouped = logits.as_strided((rows, groups, ARGMAX_GROUP), (vocab, ARGMAX_GROUP, 1))
    group_max = grouped.amax(dim=-1)
    best_group = group_max.argmax(dim=-1)
    row_ids = torch.arange(rows)
    within = grouped[row_ids, best_group].argmax(dim=-1)
    best = group_max[row_ids, best_group]
    return _with_tail(best_group * ARGMAX_GROUP + within, best, logits.t(), groups)


def _greedy_argmax_vocab_major(logits_t: torch.Tensor) -> torch.Tensor:
    """`greedy_argmax` of contiguous (vocab, rows) logits: groups of 32 vocabulary rows."""
    vocab, rows = logits_t.shape
    groups = vocab // ARGMAX_GROUP
    grouped = logits_t[: groups * ARGMAX_GROUP].view(groups, ARGMAX_GROUP, rows)
    group_max = _group_max(grouped) if rows < ARGMAX_GROUP else grouped.amax(dim=1)
    best_group = group_max.argmax(dim=0)  # (rows,)
    cols = torch.arange(rows)
    within = grouped[best_group, :, cols].argmax(dim=-1)
    best = group_max[best_group, cols]
    return _with_tail(best_group * ARGMAX_GROUP + within, best, logits_t, groups)


def _with_tail(
    result: torch.Tensor, best: torch.Tensor, logits_t: torch.Tensor, groups: int
) -> torch.Tensor:
    """`result` (each row's argmax over its first `groups` groups, whose maximum is `best`),
    or the argmax among the vocabulary past them (`logits_t`: vocab-major) where that is
    larger: a tie keeps the earlier index."""
    tail_start = groups * ARGMAX_GROUP
    if tail_start == logits_t.shape[0]:
        return result
    tail_max, tail_idx = logits_t[tail_start:].max(dim=0)
    return torch.where(tail_max > best, tail_idx + tail_start, result)


def _group_max(grouped: torch.Tensor) -> torch.Tensor:
    """`grouped.amax(dim=1)` of a contiguous (groups, 32, rows) view, by halving the groups
    with elementwise maxima (contiguous runs of 16 x rows values and less): ~4x faster for
    fewer than 32 rows here (the reduction is vectorized well only for rows a multiple of
    32), slower for more (its intermediate tensors)."""
    half = grouped.shape[1] // 2
    highest = torch.maximum(grouped[:, :half], grouped[:, half:])
    while half > 1:
        half //= 2
        highest = torch.maximum(highest[:, :half], highest[:, half:])
    return highest.squeeze(1)
