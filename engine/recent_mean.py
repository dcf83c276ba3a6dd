"""A mean over a sliding time window: what workers report as their recent TTFT / ITL."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RecentMean:
    """Mean of the samples added in the last `window_s` seconds; 0 when there are none (an
    idle worker reports no latency, so it does not hold replicas up)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float, float]] = deque()  # (time, sum, weight)

    def add(self, value: float, weight: float = 1.0) -> None:
        """One sample; `weight` > 1 stands for that many samples of `value` (e.g. tokens)."""
        self._samples.append((self.clock(), value * weight, weight))
        self._expire()

    def mean(self) -> float:
        self._expire()
        weight = sum(w for _, _, w in self._samples)
        return sum(v for _, v, _ in self._samples) / weight if weight else 0.0

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
