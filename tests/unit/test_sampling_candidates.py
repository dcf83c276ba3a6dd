"""The sampler's short path (`sampling_candidates`) keeps exactly the tokens the
whole-vocabulary path keeps, with the same probabilities, and gives way to it for every row
whose kept tokens may lie outside its candidates."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import sampler
from tandem.engine.request import Request
from tandem.engine.sampling_candidates import CANDIDATES, candidate_probabilities
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.seeds import draw_seed


def _requests(settings: list[dict[str, float]]) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**s), frozenset()) for i, s in enumerate(settings)]


def _zipf(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = -1.5 * torch.arange(1, vocab + 1, dtype=torch.float32).log()
    return torch.stack([ranks[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def _whole_vocabulary(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    return sampler._probabilities(logits.clone(), requests)


SHORT = [
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    {"temperature": 0.6, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20, "top_p": 0.95},
    {"temperature": 1.3, "top_k": 1},
    {"temperature": 0.7, "top_k": CANDIDATES},
    {"temperature": 1.2, "top_p": 0.5},
    {"temperature": 1.0, "top_k": 50, "min_p": 0.05},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.9, "min_p": 0.02, "top_p": 0.8},
]


@pytest.mark.parametrize("vocab", [300, 32000])
def test_the_short_path_keeps_the_tokens_and_probabilities_of_the_long_one(vocab: int) -> None:
    logits = _zipf(len(SHORT), vocab, seed=vocab)
    requests = _requests(SHORT)
    short = candidate_probabilities(sampler._scaled(logits.clone(), requests), requests)
    assert short.rows == list(range(len(SHORT))) and short.fits.all()
    assert torch.equal(short.ids, short.ids.sort(dim=-1).values)  # ascending, as `draw` sums
    want = _whole_vocabulary(logits, requests)
    got = torch.zeros_like(want).scatter_(1, short.ids, short.probs)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)
    kept = (got > 0).sum(dim=-1).tolist()
    assert kept[3] == 1 and kept[4] == CANDIDATES and all(1 < k < CANDIDATES for k in kept[:3])
    assert kept[6] < 50 and all(1 < k < CANDIDATES for k in kept[6:])  # (min-p dropped some)


def test_rows_whose_kept_tokens_may_lie_outside_the_candidates_take_the_long_path() -> None:
    vocab = 5000
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(1, vocab, generator=gen) * 0.3  # its 0.9 nucleus: thousands of tokens
    peaked = _zipf(1, vocab, seed=2)
    tied = peaked.clone()
    tied[0, :400] = 5.0  # 400 tokens tie for the largest logit: top-k 10 keeps them all
    masked = torch.full((1, vocab), float("-inf"))
    masked[0, :3] = torch.tensor([1.0, 2.0, 3.0])  # fewer allowed tokens than k
    cases = [
        (flat, {"temperature": 1.0, "top_p": 0.9}),
        (tied, {"temperature": 1.0, "top_k": 10}),
        (masked, {"temperature": 1.0, "top_k": 10}),
        (peaked, {"temperature": 1.0}),  # no filter: every token stays
        (peaked, {"temperature": 2.0, "top_p": 0.5}),  # flatter: its nucleus is wider
        (peaked, {"temperature": 1.0, "top_k": CANDIDATES + 1}),
        (peaked, {"temperature": 1.0, "min_p": 0.0001}),  # its floor: past the candidates
        (peaked, {"temperature": 1.0, "top_k": 20, "min_p": 0.1}),  # (these fit)
        (peaked, {"temperature": 1.0, "top_k": 20}),
    ]
    logits = torch.cat([row for row, _ in cases])
    requests = _requests([s for _, s in cases])
    short = candidate_probabilities(sampler._scaled(logits.clone(), requests), requests)
    # (no filter, or a top-k past the candidates: not even looked at)
    assert short.rows == [0, 1, 2, 4, 6, 7, 8]
    assert short.fits.tolist() == [False, False, False, False, False, True, True]


def test_sample_draws_the_tokens_the_long_path_draws_for_the_same_seeds() -> None:
    """Seeded draws: the same uniform number searched in the same cumulative sums (candidates
    in ascending id order) picks the same token, whichever path built the distribution."""
    vocab, draws = 32000, 200
    logits = _zipf(1, vocab, seed=5)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    request = Request("r", [1], params, frozenset())
    probs = _whole_vocabulary(logits, [request])[0]
    same = 0
    for n in range(draws):
        request.params = params.model_copy(update={"seed": n})
        request.generator = torch.Generator()
        seed = draw_seed(n, len(request.sampled_token_ids))
        long_token = sampler.draw(probs, torch.Generator().manual_seed(seed))
        short_token = sampler._draw_rows(logits.clone(), [request])[0]
        same += short_token == long_token
    assert same == draws  # (only a uniform number within rounding of a boundary could differ)
    assert len({sampler._draw_rows(logits.clone(), [request])[0] for _ in range(5)}) == 1
    unseeded = Request("u", [1], params.model_copy(update={"seed": None}), frozenset())
    assert len({sampler._draw_rows(logits.clone(), [unseeded])[0] for _ in range(50)}) > 1


def test_sample_changes_only_the_rows_it_samples_and_keeps_greedy_rows_exact() -> None:
    vocab = 32000
    logits = _zipf(3, vocab, seed=9)
    requests = _requests([{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}, {}])
    requests[2].params = SamplingParams(temperature=0.8, top_k=5, seed=3)
    requests[2].generator = torch.Generator()
    want_greedy = int(logits[0].argmax())
    top5 = set(logits[2].topk(5).indices.tolist())
    tokens = sampler.sample(logits.clone(), requests)
    assert tokens[0] == want_greedy and tokens[2] in top5
    assert logits[1, tokens[1]] >= logits[1].topk(CANDIDATES).values[-1]


@pytest.mark.parametrize(
    "settings",
    [{"top_k": 40, "top_p": 0.9}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 1000}],
    ids=["short", "short-no-k", "short-min-p", "long"],
)
def test_a_seeded_row_draws_the_same_token_alone_and_in_any_batch(
    settings: dict[str, float],
) -> None:
    """Rows are filtered together but each on its own: a seeded request's token does not
    depend on the rows beside it (what lets a cluster's decode worker, or a second attempt,
    repeat a colocated run's seeded output)."""
    vocab = 32000
    logits = _zipf(4, vocab, seed=11)
    others = [{"temperature": 1.0, "top_k": 5}, {"temperature": 0.0}, {"temperature": 0.5}]
    for n in range(40):
        seeded = Request("s", [1], SamplingParams(temperature=0.9, seed=n, **settings), frozenset())
        alone = sampler.sample(logits[:1].clone(), [seeded])[0]
        seeded.generator = torch.Generator()
        batch = [seeded, *_requests(others)]
        assert sampler.sample(logits.clone(), batch)[0] == alone
        seeded.generator = torch.Generator()
        shuffled = [batch[2], batch[3], batch[0], batch[1]]
        rows = logits[torch.tensor([2, 3, 0, 1])].clone()
        assert sampler.sample(rows, shuffled)[2] == alone
