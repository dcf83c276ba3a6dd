"""The two-level greedy argmax equals torch.argmax, ties and tail columns included."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.greedy_argmax import greedy_argmax


@pytest.mark.parametrize("vocab", [512, 4096, 32000, 32001, 50257])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_greedy_argmax_equals_argmax(vocab: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(vocab * 100 + rows)
    x = torch.randn(rows, vocab, generator=gen)
    x[0, 5] = x[0].max() + 1
    x[0, vocab - 1] = x[0, 5]  # a tie: the first index wins
    if rows > 1:
        x[1, vocab - 1] = x[1].max() + 1  # the max in the tail past the last full group
    if rows > 2:
        x[2] = 0.0  # all equal
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [32000, 32010])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 31, 32, 33, 64])
def test_greedy_argmax_on_vocab_major_logits(vocab: int, rows: int) -> None:
    """(Fewer than 32 rows take the halving group maximum, `_group_max`.)"""
    gen = torch.Generator().manual_seed(rows)
    logits_t = torch.randn(vocab, rows, generator=gen)
    logits_t[vocab - 1, 0] = logits_t[:, 0].max() + 1  # in the last group, or past the groups
    if rows > 1:
        logits_t[7, 1] = logits_t[40, 1] = logits_t[:, 1].max() + 1  # a tie: the first wins
    if rows > 2:
        logits_t[:, 2] = 0.0  # all equal
    logits = logits_t.t()
    assert rows == 1 or not logits.is_contiguous()
    assert torch.equal(greedy_argmax(logits), logits.contiguous().argmax(dim=-1))
