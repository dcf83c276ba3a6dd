"""A request's lifecycle as the router sees it (DESIGN §2): wall-clock marks and the workers'
own stage timings, turned into per-stage durations for logs, headers and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestTimings:
    """Wall-clock marks of one request's lifecycle (DESIGN §2) and its per-stage durations."""

    arrival: float = field(default_factory=time.time)
    marks: dict[str, float] = field(default_factory=dict)
    worker: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.time())

    def stages_ms(self) -> dict[str, float]:
        m, start = self.marks, self.arrival
        out: dict[str, float] = {}

        def span(name: str, a: float | None, b: float | None) -> None:
            if a is not None and b is not None:
                out[name] = round((b - a) * 1000, 3)

        span("tokenize", start, m.get("tokenized"))
        span("reserve", m.get("tokenized"), m.get("reserved"))
        for key in ("prefill_s", "transfer_tail_s", "transfer_wait_s", "decode_s"):
            if key in self.worker:
                out[key.removesuffix("_s")] = round(self.worker[key] * 1000, 3)
        span("ttft", start, m.get("first_token"))
        span("decode_stream", m.get("first_token"), m.get("finished"))
        span("e2e", start, m.get("finished"))
        return out
