"""Instrumentation the benchmarks put on a live `LLMEngine`: step counting, per-phase timers, and a
check that a batch is in steady decode.

Both hooks shadow bound methods with instance attributes and remove them again on exit, so the
engine is left as it was.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

import tandem.engine.llm_engine as llm_engine_mod
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model import AttentionMetadata
from tandem.kernels.kv_cache import KVCachePool

T = TypeVar("T")


@contextmanager
def count_steps(engine: LLMEngine) -> Iterator[list[int]]:
    """Counts `engine.step()` calls; the count is the single item of the yielded list."""
    count = [0]
    inner = engine.step

    def step() -> Any:
        count[0] += 1
        return inner()

    engine.step = step  # type: ignore[method-assign]
    try:
        yield count
    finally:
        del engine.step


class PhaseTimer:
    """perf_counter timers around the parts of a step: schedule, prepare, model, sample, process,
    advance. Every call's duration is kept; for the model also its batch shape (tokens in the
    batch, rows sampled). `sample` is the module-level function `llm_engine` imported, so it is
    patched in that module."""

    PHASES = ("schedule", "prepare", "model", "sample", "process", "advance")

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.model_shapes: list[tuple[int, int]] = []
        self._orig_sample = llm_engine_mod.sample_step
        self._orig_model = engine.runner.model
        sched, runner, proc = engine.scheduler, engine.runner, engine.output_processor
        sched.schedule = self._wrap("schedule", sched.schedule)  # type: ignore[method-assign]
        sched.advance = self._wrap("advance", sched.advance)  # type: ignore[method-assign]
        runner.prepare = self._wrap("prepare", runner.prepare)  # type: ignore[method-assign]
        proc.process = self._wrap("process", proc.process)  # type: ignore[method-assign]
        llm_engine_mod.sample_step = self._wrap("sample", llm_engine_mod.sample_step)
        model, shapes = self._wrap("model", runner.model), self.model_shapes

        def model_call(
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            meta: AttentionMetadata,
            kv_pool: KVCachePool,
            logits_indices: torch.Tensor,
        ) -> torch.Tensor:
            shapes.append((int(input_ids.shape[0]), int(logits_indices.shape[0])))
            return model(input_ids, positions, meta, kv_pool, logits_indices)

        runner.model = model_call

    def _wrap(self, name: str, fn: Callable[..., T]) -> Callable[..., T]:
        record, clock = self.durations[name].append, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> T:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                record(clock() - t0)

        return timed

    @property
    def totals(self) -> dict[str, float]:
        return {k: sum(self.durations[k]) for k in self.PHASES if self.durations[k]}

    def medians_us(self) -> dict[str, float]:
        return {
            k: round(statistics.median(self.durations[k]) * 1e6, 1)
            for k in self.PHASES
            if self.durations[k]
        }

    def restore(self) -> None:
        e = self.engine
        del e.scheduler.schedule, e.scheduler.advance, e.runner.prepare, e.output_processor.process
        e.runner.model = self._orig_model
        llm_engine_mod.sample_step = self._orig_sample


@contextmanager
def phase_timer(engine: LLMEngine) -> Iterator[PhaseTimer]:
    timer = PhaseTimer(engine)
    try:
        yield timer
    finally:
        timer.restore()


def is_steady(engine: LLMEngine, n: int) -> bool:
    """True when exactly `n` requests run, none waits, and each has one token to compute."""
    s = engine.scheduler
    return (
        not s.waiting
        and len(s.running) == n
        and all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)
    )
