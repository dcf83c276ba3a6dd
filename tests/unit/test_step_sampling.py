"""A step's tokens when its batch mixes requests with penalties, biases or logprobs and requests
without: on a GPU only the former's rows cross to the host (`step_sampling.sample_step`), and
the tokens, logprobs' rows and raw logits are those of sampling the whole batch on the host."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.engine import step_sampling
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

VOCAB = 512
SETTINGS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.9, "top_k": 40, "seed": 7},
    {"temperature": 0.0, "logprobs": 3},
    {"temperature": 0.8, "top_p": 0.9, "seed": 11, "presence_penalty": 1.5, "logprobs": 2},
    {"temperature": 1.0, "seed": 5, "min_p": 0.05},
    {"temperature": 0.0, "logit_bias": {17: 100.0}},
    {"temperature": 0.7, "seed": 3, "frequency_penalty": 0.5},
    {"temperature": 0.0, "min_tokens": 3},
]
EXTRA = [2, 3, 5, 6]


def _batch() -> list[Request]:
    requests = []
    for i, settings in enumerate(SETTINGS):
        request = Request(f"r{i}", [1, 2, 3], SamplingParams(**settings), frozenset({9}))
        request.token_ids.append(4 + i)  # (an output token, for the penalties to count)
        requests.append(request)
    assert [i for i, r in enumerate(requests) if r.sampling_extras] == EXTRA
    return requests


@pytest.mark.parametrize("seed", range(6))
def test_split_sampling_gives_the_whole_batch_s_tokens_and_logprob_rows(seed: int) -> None:
    logits = torch.randn(len(SETTINGS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    together = step_sampling.sample_step(logits.clone(), _batch(), EXTRA, split=False)
    apart = step_sampling.sample_step(logits.clone(), _batch(), EXTRA, split=True)
    assert apart.tokens == together.tokens
    assert apart.tokens[5] == 17  # (the biased row)
    assert apart.logprob_rows == together.logprob_rows == [2, 3]
    assert apart.raw is not None and together.raw is not None
    assert torch.equal(apart.raw, together.raw) and torch.equal(apart.raw, logits[[2, 3]])


def test_off_the_host_only_the_extra_rows_cross_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    crossed: list[tuple[int, ...]] = []  # the shape of every copy to the host
    sampled: list[tuple[str, int, tuple[int, ...]]] = []

    def cpu(tensor: torch.Tensor) -> torch.Tensor:
        crossed.append(tuple(tensor.shape))
        return torch.zeros(tensor.shape)

    def sample(logits: torch.Tensor, requests: Any, extra_rows: Any = ()) -> list[int]:
        sampled.append((logits.device.type, len(logits), tuple(extra_rows)))
        return [0] * len(requests)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(step_sampling, "sample", sample)
    logits = torch.empty(VOCAB, len(SETTINGS), device="meta").t()  # (a GPU's, vocab-major)
    out = step_sampling.sample_step(logits, _batch(), EXTRA)
    assert crossed == [(4, VOCAB)]
    assert sampled == [("cpu", 4, (0, 1, 2, 3)), ("meta", 4, ())]
    assert out.logprob_rows == [2, 3]
    crossed.clear()
    step_sampling.sample_step(torch.zeros(len(SETTINGS), VOCAB), _batch(), EXTRA)
    assert crossed == [(len(SETTINGS), VOCAB)]  # (on the host already: one batch, no split)
