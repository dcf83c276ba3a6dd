"""A worker's measured prefill throughput, which it reports for the router's admission control
(the predicted time to first token of a request queued behind others)."""

from __future__ import annotations


class PrefillRate:
    """Prompt tokens computed per second: a moving average over the steps that prefilled."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None
        """None until a step prefilled (the router then assumes its default)."""

    def add(self, tokens: int, seconds: float) -> None:
        """One step that computed `tokens` prompt tokens in `seconds` (a step of lone sampled
        tokens, 1 or none, is not prefill work and is left out)."""
        if tokens > 1 and seconds > 0:
            rate, old = tokens / seconds, self.tokens_per_s
            self.tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate
