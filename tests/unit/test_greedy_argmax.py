"""The two-level greedy argmax equals torch.argmax, ties and tail columns included."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampler import greedy_argmax


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


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_greedy_argmax_on_vocab_major_logits(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    logits_t = torch.randn(32000, rows, generator=gen)
    logits_t[31999, 0] = logits_t[:, 0].max() + 1
    logits = logits_t.t()
    assert rows == 1 or not logits.is_contiguous()
    assert torch.equal(greedy_argmax(logits), logits.contiguous().argmax(dim=-1))
