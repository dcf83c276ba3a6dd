"""One benchmark run from settings to result: the dataset, the load, the metrics, the JSON.

The CLI (`tandem bench serve`) and the scenarios (`bench/scenarios/`) both call `run_benchmark`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.bench.serving.datasets import (
    Conversation,
    MixedSpec,
    mixed_dataset,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from tandem.bench.serving.metrics import METRICS, BenchmarkMetrics, calculate_metrics
from tandem.bench.serving.prompts import PromptMaker, TokenPrompts, WordPrompts
from tandem.bench.serving.records import RequestRecord, count_output_tokens
from tandem.bench.serving.result import result_json
from tandem.bench.serving.runner import LoadConfig, run_load

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetOptions:
    name: str = "random"
    num_prompts: int = 100
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    sp_num_groups: int = 4
    sp_prompts_per_group: int = 8
    sp_system_prompt_len: int = 256
    sp_question_len: int = 32
    sp_output_len: int = 32
    mt_num_turns: int = 4
    mt_first_len: int = 128
    mt_turn_len: int = 32
    mt_output_len: int = 32
    mixed: MixedSpec = field(default_factory=MixedSpec)
    random_prefix_len: int = 0  # (tokens of one random prefix every random prompt starts with)


def prompt_maker(
    tokenizer: str | Path | None, count_tokens: Callable[[str], int] | None = None
) -> PromptMaker:
    """Exact token-id prompts with the model's tokenizer (a local checkpoint or tokenizer
    directory), else word prompts, of lengths as `count_tokens` counts (the server's)."""
    if tokenizer is not None:
        return TokenPrompts.from_pretrained(tokenizer)
    if count_tokens is not None:
        try:
            return WordPrompts.calibrated(count_tokens)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("the server did not count tokens (%s): one token a word is assumed", exc)
    return WordPrompts()


def server_token_counter(
    base_url: str, model: str, headers: dict[str, str] | None = None
) -> Callable[[str], int]:
    """Counts a text's tokens with the server's `/tokenize` (tandem's and vLLM's)."""

    def count(text: str) -> int:
        body = json.dumps({"model": model, "prompt": text}).encode()
        request = urllib.request.Request(
            base_url.rstrip("/") + "/tokenize",
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return int(json.loads(reply.read())["count"])

    return count


def make_conversations(
    options: DatasetOptions, maker: PromptMaker, seed: int
) -> list[Conversation]:
    rng = random.Random(seed)
    o = options
    if o.name == "random":
        return random_dataset(
            maker,
            rng,
            o.num_prompts,
            o.random_input_len,
            o.random_output_len,
            o.random_range_ratio,
            o.random_prefix_len,
        )
    if o.name == "shared-prefix":
        return shared_prefix_dataset(
            maker,
            rng,
            o.sp_num_groups,
            o.sp_prompts_per_group,
            o.sp_system_prompt_len,
            o.sp_question_len,
            o.sp_output_len,
        )
    if o.name == "multi-turn":
        return multi_turn_dataset(
            maker,
            rng,
            o.num_prompts,
            o.mt_num_turns,
            o.mt_first_len,
            o.mt_turn_len,
            o.mt_output_len,
        )
    if o.name == "mixed":
        return mixed_dataset(maker, rng, o.num_prompts, o.mixed)
    raise ValueError(f"unknown dataset {o.name!r}")


@dataclass
class BenchmarkRun:
    metrics: BenchmarkMetrics
    records: list[RequestRecord]
    result: dict[str, Any]


def run_benchmark(
    load: LoadConfig,
    conversations: list[Conversation],
    maker: PromptMaker,
    *,
    slos: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (90, 99),
    info: dict[str, Any] | None = None,
    detailed: bool = False,
    shown: Sequence[str] = METRICS,
    warmups: int = 0,
) -> BenchmarkRun:
    """Runs the load (its own event loop) and computes the metrics and the result JSON;
    `warmups` requests of the first prompt go first, uncounted (vLLM's --num-warmups)."""
    if warmups and conversations:
        first = conversations[0]
        warm = [Conversation(first.category, first.turns[:1], first.prefix)] * warmups
        asyncio.run(run_load(replace(load, progress=False, request_rate=math.inf), warm, maker))
    outcome = asyncio.run(run_load(load, conversations, maker))
    if isinstance(maker, TokenPrompts):  # (a tokenizer: output tokens without usage counted)
        count_output_tokens(outcome.records, maker.length)
    metrics = calculate_metrics(outcome.records, outcome.duration, slos, percentiles)
    info = {
        "model_id": load.model,
        "num_prompts": len(outcome.records),
        "request_rate": load.request_rate,
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        **(info or {}),
    }
    result = result_json(
        metrics,
        outcome.records,
        info,
        slos=slos,
        percentiles=percentiles,
        detailed=detailed,
        shown=shown,
    )
    return BenchmarkRun(metrics, outcome.records, result)
