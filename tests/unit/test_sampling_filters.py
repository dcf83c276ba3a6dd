"""top-k and top-p keep exactly the tokens a sort of the whole vocabulary keeps (transformers'
TopK/TopP warpers' rule), on the fast paths too: `topk` for top-k, and for top-p the most
likely `TOP_P_CANDIDATES` tokens when the nucleus lies among them."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import sampler
from tandem.engine.sampler import TOP_P_CANDIDATES, _apply_top_k, _apply_top_p


def _sorted_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _sorted_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    kept = sampler._top_p_sorted(logits, top_ps)  # (the whole vocabulary, sorted)
    return torch.where((top_ps >= 1.0)[:, None], logits, kept)


def _rows(vocab: int, peaked: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab + peaked)
    if not peaked:  # a flat row: its 0.9 nucleus needs far more than the candidates
        return torch.randn(6, vocab, generator=gen) * 0.5
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)  # Zipf-like, as a trained model's
    return torch.stack(
        [(-1.5 * ranks.log())[torch.randperm(vocab, generator=gen)] for _ in range(6)]
    )


@pytest.mark.parametrize("vocab", [100, 5000, 32000])
@pytest.mark.parametrize("peaked", [True, False])
def test_top_k_and_top_p_keep_what_a_full_sort_keeps(vocab: int, peaked: bool) -> None:
    logits = _rows(vocab, peaked)
    top_ks = [50, -1, vocab, 1, 1000, 7]
    assert torch.equal(_apply_top_k(logits, top_ks), _sorted_top_k(logits, top_ks))
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.1, 0.95])
    for rows in (logits, _apply_top_k(logits, [50] * 6)):
        assert torch.equal(_apply_top_p(rows, top_ps), _sorted_top_p(rows, top_ps))


def test_top_p_looks_among_the_candidates_only_when_the_nucleus_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sorts: list[int] = []
    sorted_path = sampler._top_p_sorted
    monkeypatch.setattr(
        sampler, "_top_p_sorted", lambda x, p: sorts.append(len(x)) or sorted_path(x, p)
    )
    peaked, flat = _rows(32000, True), _rows(32000, False)
    top_ps = torch.full((6,), 0.9)
    kept = _apply_top_p(peaked, top_ps)
    assert sorts == [] and int(torch.isfinite(kept).sum(dim=-1).max()) < TOP_P_CANDIDATES
    _apply_top_p(torch.cat([peaked[:3], flat[:3]]), top_ps)
    assert sorts == [3]  # (only the flat rows)
