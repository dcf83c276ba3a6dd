"""The prefill rate a worker reports for admission (`engine/prefill_rate.py`)."""

from __future__ import annotations

import pytest

from tandem.engine.prefill_rate import PrefillRate


def test_steps_weigh_by_their_tokens() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None
    rate.add(2048, 1.0)  # (2,048 tokens/s)
    rate.add(4, 0.01)  # (a small step at 400 tokens/s barely moves it)
    assert rate.tokens_per_s == pytest.approx((0.8 * 2048 + 4) / (0.8 * 1.0 + 0.01))
    assert rate.tokens_per_s > 2000


def test_a_decode_worker_s_step_counts_only_when_mostly_prefill() -> None:
    """A 16-token tail beside 64 sampled tokens timed the batch, not the prefill (it read 9x
    too slow and refused requests that would meet their deadlines)."""
    rate = PrefillRate(min_tokens=64)
    rate.add(16, 0.064, step_tokens=80)  # (too few prompt tokens)
    rate.add(100, 0.2, step_tokens=300)  # (mostly sampled tokens)
    assert rate.tokens_per_s is None
    rate.add(1024, 0.5, step_tokens=1040)
    assert rate.tokens_per_s == pytest.approx(2048)
