"""A router `Serving` that prepares requests for real (template, tokens, checks, params) and
answers each with one token "X" instead of asking a cluster: for tests of the API layer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tandem.engine.tokenizer import Tokenizer
from tandem.router.prepared import Prepared
from tandem.router.serving import Serving


class Limits:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    async def limits(self) -> dict[str, int]:
        return {"max_model_len": 2048, "vocab_size": self.vocab_size}


class Admission:
    def priority(self, priority: int | None, user: str | None) -> int:
        return priority or 0

    def deadline_ms(self, deadline_ms: float | None, user: str | None) -> float | None:
        return deadline_ms


class Planner:
    admission = Admission()
    policy_name = "test"


class OneTokenServing(Serving):
    """Prepares for real (template, tokens, checks); every request then writes "X"."""

    async def _route(self, req: Prepared) -> None:
        self.last = req

    async def run(self, req: Prepared) -> AsyncIterator[dict[str, Any]]:
        req.started = True
        req.token_ids, req.text, req.completion_tokens = [70], "X", 1
        req.finish_reason = "length"
        yield {"token_ids": [70], "text": "X", "finish_reason": "length"}

    async def abandon(self, req: Prepared, refused: Any = None) -> None:
        return None


_metrics: list[Any] = []  # (one RouterMetrics for the module: its series register once)


def fake_serving(path: Path, template: str, vocab_size: int = 512) -> OneTokenServing:
    tokenizer = Tokenizer.from_pretrained(path)
    tokenizer.hf.chat_template = template
    metrics = _metrics[0] if _metrics else None
    serving = OneTokenServing(Limits(vocab_size), Planner(), tokenizer, "tiny", metrics=metrics)  # type: ignore[arg-type]
    _metrics[:] = [serving.metrics]
    return serving
