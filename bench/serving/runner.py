"""Open-loop load: conversations start at gamma-distributed times, each request streams.

Arrivals follow `vllm bench serve`: gaps between arrivals are gamma distributed with shape
`burstiness` and mean `1 / request_rate` (burstiness 1 is a Poisson process; lower is
burstier); an infinite rate sends everything at once. Arrivals start conversations; a
conversation's next turn is sent when its previous reply is complete (its prompt contains that
reply). `max_concurrency` caps requests in flight, whatever the arrival process says.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from tandem.bench.serving.client import completion_payload, send_completion
from tandem.bench.serving.datasets import Conversation, num_requests
from tandem.bench.serving.prompts import PromptMaker
from tandem.bench.serving.records import RequestRecord


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 6 * 3600
    progress: bool = True
    api_key: str | None = None  # sent as `Authorization: Bearer <key>`

    @property
    def headers(self) -> dict[str, str]:
        return bearer_headers(self.api_key)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """`Authorization: Bearer <key>` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Offsets (seconds) of `n` arrivals: the first at 0, then gamma-distributed gaps."""
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration: float


async def run_load(
    config: LoadConfig, conversations: Sequence[Conversation], maker: PromptMaker
) -> LoadResult:
    """Sends every turn of every conversation; records come back in the order they were sent
    (turns left unsent after a failed turn are failed records too)."""
    starts = arrival_times(len(conversations), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency or num_requests(list(conversations)) or 1)
    records: list[RequestRecord] = []
    bar = tqdm(total=num_requests(list(conversations)), disable=not config.progress, unit="req")
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=config.headers
    ) as session:
        bench_start = time.perf_counter()

        async def converse(conv: Conversation, start: float) -> None:
            await asyncio.sleep(max(0.0, bench_start + start - time.perf_counter()))
            history = maker.join(conv.prefix)
            for i, turn in enumerate(conv.turns):
                prompt = maker.join(history, turn.user)
                record = RequestRecord(maker.length(prompt), turn.output_len, conv.category)
                records.append(record)
                payload = completion_payload(
                    config.model, prompt, turn.output_len, config.extra_body
                )
                async with limit:
                    await send_completion(session, config.url, payload, record, bench_start)
                bar.update(1)
                if not record.success:  # the history is broken: the rest is not sent
                    for later in conv.turns[i + 1 :]:
                        records.append(_unsent(later.output_len, conv.category))
                        bar.update(1)
                    return
                history = maker.join(prompt, maker.from_text(record.generated_text))

        await asyncio.gather(*(converse(c, s) for c, s in zip(conversations, starts, strict=True)))
        duration = time.perf_counter() - bench_start
    bar.close()
    return LoadResult(records, duration)


def _unsent(max_tokens: int, category: str) -> RequestRecord:
    error = "not sent: an earlier turn of its conversation failed"
    return RequestRecord(0, max_tokens, category, error=error)
