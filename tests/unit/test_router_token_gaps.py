"""The router's inter-token latency histogram counts every token after a request's first,
also those that came in the first token's item (the prefill worker's first token and the
decode worker's second can arrive together: one gap too few was counted then)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tandem.engine.tokenizer import Tokenizer
from tandem.router.prepared import Prepared
from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving
from tests.unit.fake_serving import Limits, OneTokenServing, Planner


class _ChunkedServing(OneTokenServing):
    """Streams the tokens 1..6 as the cluster may bundle them: the first item brings two."""

    def _generate(self, req: Prepared) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        async def items() -> AsyncIterator[dict[str, Any]]:
            for ids in ([1, 2], [3], [4, 5], [6]):
                done = "length" if ids == [6] else None
                yield {"token_ids": ids, "text": "x" * len(ids), "finish_reason": done}

        return items()  # type: ignore[return-value]

    run = Serving.run  # (the real one, over `_generate`)


def test_every_token_after_the_first_counts_one_inter_token_gap(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """Tokens that came in the first item with the first token count their gaps too (0 s):
    the histogram counted one gap too few per request when the first item brought two."""
    serving = _ChunkedServing(
        Limits(512), Planner(), Tokenizer.from_pretrained(tiny_checkpoint()), "tiny"
    )
    gaps = "tandem:inter_token_latency_seconds_count"
    before = serving.metrics.registry.get_sample_value(gaps, serving.metrics.labels) or 0.0
    req = asyncio.run(
        serving.prepare("r", None, [1, 2, 3], 6, {"temperature": 0.0}, RequestTimings())
    )

    async def drain() -> None:
        async for _ in serving.run(req):
            pass

    asyncio.run(drain())
    after = serving.metrics.registry.get_sample_value(gaps, serving.metrics.labels)
    assert after - before == 5
