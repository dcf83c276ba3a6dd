"""A worker's measured prefill throughput, which it reports for the router's admission control
(the predicted time to first token of a request queued behind others)."""

from __future__ import annotations


class PrefillRate:
    """Prompt tokens computed per second over recent steps that prefilled: decayed sums of
    tokens and seconds (each step weighs by its tokens, so a few small steps do not pull the
    rate down). A step counts when it prefilled at least `min_tokens` and those were at least
    half its tokens (a decode worker's steps are mostly sampled tokens, whose time would be
    taken for prefill's)."""

    DECAY = 0.8  # (what the sums keep of their past at each step counted)

    def __init__(self, min_tokens: int = 2) -> None:
        self.min_tokens = min_tokens
        self._tokens = 0.0
        self._seconds = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """None until a step counted (the router then assumes its default)."""
        return self._tokens / self._seconds if self._seconds > 0 else None

    def add(self, tokens: int, seconds: float, step_tokens: int | None = None) -> None:
        """One step that computed `tokens` prompt tokens in `seconds`, of `step_tokens` in all
        (default: only those)."""
        if tokens < self.min_tokens or seconds <= 0 or tokens * 2 < (step_tokens or tokens):
            return
        self._tokens = self.DECAY * self._tokens + tokens
        self._seconds = self.DECAY * self._seconds + seconds
