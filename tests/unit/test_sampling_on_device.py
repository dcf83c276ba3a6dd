"""The sampler's filters run on the logits' device (a GPU's), so that only token ids and each
sampled row's candidates cross to the host: every tensor they make is made there. On this
CPU-only machine the logits are on torch's "meta" device, whose tensors hold no data but whose
ops refuse a tensor of another device (the CPU) as a GPU's do; what needs values (the draws,
which are made on the host) is not run. `tests/gpu/` runs the whole sampler on CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.engine import sampler
from tandem.engine.greedy_argmax import greedy_argmax
from tandem.engine.request import Request
from tandem.engine.sampling_candidates import candidate_probabilities
from tandem.engine.sampling_params import SamplingParams

SETTINGS: list[dict[str, float]] = [
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    {"temperature": 0.6, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 1000},
    {"temperature": 0.7, "min_p": 0.1, "top_k": 20},
    {"temperature": 1.0, "min_tokens": 4},
]


def _requests() -> list[Request]:
    return [
        Request(f"r{i}", [1], SamplingParams(**s), frozenset({2, 3}))  # type: ignore[arg-type]
        for i, s in enumerate(SETTINGS)
    ]


def test_the_filters_make_every_tensor_on_the_logits_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []  # the device of every tensor made from values (in-place ops on
    make = torch.tensor  # meta tensors do not check their operands' device)

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        made.append(str(kwargs.get("device", "cpu")))
        return make(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    requests = _requests()
    logits = torch.empty(32000, len(requests), device="meta").t()  # vocab-major, as a model's
    sampler._suppress_stops_before_min_tokens(logits, requests)
    assert greedy_argmax(logits).device.type == "meta"
    for rows, short_rows in (([0, 1, 2, 3, 4], [0, 1, 3]), ([0, 1, 3], [0, 1, 2])):
        chosen = [requests[i] for i in rows]  # (every row, in place; then a copy of some)
        scaled = sampler._scaled(sampler.rows_of(logits, rows), chosen)
        short = candidate_probabilities(scaled, chosen)
        assert short.rows == short_rows and short.ids.shape == short.probs.shape == (3, 256)
        assert {t.device.type for t in (short.fits, short.ids, short.probs)} == {"meta"}
    scaled = sampler._scaled(sampler.rows_of(logits, [2, 3, 4]), requests[2:])
    filtered = sampler._filtered(scaled, requests[2:])  # (top-k past the candidates, min-p)
    assert filtered.device.type == "meta" and filtered.shape == (3, 32000)
    assert made and set(made) == {"meta"}, made


def test_a_tensor_made_on_the_host_is_caught() -> None:
    """The check itself: a filter given a host tensor for logits elsewhere fails."""
    logits = torch.empty(3, 5000, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        sampler._apply_min_p(logits, torch.tensor([0.1, 0.2, 0.3]))
