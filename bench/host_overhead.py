"""Host overhead per engine step: the model is replaced by a no-op, N requests are in steady
decode, and each `engine.step()` is timed against the target 200 + 5*N microseconds.

Two variants of the no-op's logits:

- ``vocab`` (the main figure): zero logits as wide as the vocabulary, in the layout the real
  model returns (vocab-major, a transposed view), so the zero fill, the greedy argmax over the
  vocabulary and the ``.tolist()`` are counted, as in real decoding;
- ``narrow``: logits of width 1, which leaves only the pure Python host path (schedule, prepare
  the runner inputs, process the outputs, advance).

Run on its own, it prints its own JSON summary as the last stdout line::

    .venv/bin/python bench/host_overhead.py [--quick] [--threads 2] [--wait-quiet 60]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    Workload,
    add_common_args,
    greedy,
    log,
    print_summary,
    setup,
    timed,
    wait_for_quiet,
)
from bench.engine_hooks import is_steady, phase_timer  # noqa: E402
from tandem import LLM  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.model import AttentionMetadata  # noqa: E402
from tandem.kernels.kv_cache import KVCachePool  # noqa: E402

WARM_STEPS = 20  # steps in steady decode before timing
MAX_TOKENS = 1500  # never reached: the requests are aborted after timing


class NoOpModel:
    """Stands in for the model: zero logits for the rows to sample, no compute, no KV writes.

    The logits mirror `CausalLM.forward`: a (rows, width) transposed view of a (width, columns)
    buffer, with two columns when one row is sampled."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVCachePool,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        rows = len(logits_indices)
        return torch.zeros(self.width, max(rows, 2))[:, :rows].t()


def _timed_steps(engine: LLMEngine, n: int, steps: int) -> list[float]:
    times = []
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        outs = engine.step()
        times.append(clock() - t0)
        if len(outs) != n:
            raise RuntimeError(f"N={n}: a step returned {len(outs)} tokens, expected {n}")
    return times


def _reach_steady(engine: LLMEngine, n: int) -> None:
    for _ in range(1000):
        if is_steady(engine, n):
            break
        engine.step()
    else:
        raise RuntimeError(f"N={n}: requests never reached steady decode")
    for _ in range(WARM_STEPS):
        engine.step()
    if not is_steady(engine, n):
        raise RuntimeError(f"N={n}: the batch left steady decode during the warm-up")


def host_overhead(
    model_dir: Path, vocab: int, w: Workload, *, logits_width: int, wait_quiet_s: float = 0.0
) -> list[dict[str, Any]]:
    """Steady-decode `engine.step()` times with `NoOpModel(logits_width)`, one row per N.

    Per N: add N requests (random 16-token prompts, max_tokens far away), step until all are in
    steady decode, `WARM_STEPS` more, then time `overhead_steps` steps (clean), then the same
    number again under `PhaseTimer` for the per-phase medians. The requests are then aborted.
    `num_kv_blocks` is sized so that every N fits.
    """
    bs = 16
    max_n = max(w.overhead_ns)
    tokens_per_req = w.overhead_prompt_len + 2 * (WARM_STEPS + w.overhead_steps) + 64
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=bs,
        num_kv_blocks=max_n * math.ceil(tokens_per_req / bs) + 64,
        max_num_seqs=max(256, max_n),
        max_num_batched_tokens=2048,
        max_model_len=2048,
    )
    engine = llm.engine
    engine.runner.model = NoOpModel(logits_width)
    rng = random.Random(2)
    results = []
    for n in w.overhead_ns:
        reqs = [
            engine.add_request(
                [rng.randrange(3, vocab) for _ in range(w.overhead_prompt_len)], greedy(MAX_TOKENS)
            )
            for _ in range(n)
        ]
        _reach_steady(engine, n)
        wait_for_quiet(wait_quiet_s)
        gc.collect()
        with timed() as t:
            times = _timed_steps(engine, n, w.overhead_steps)
        with phase_timer(engine) as timer:
            _timed_steps(engine, n, w.overhead_steps)
        for r in reqs:
            engine.abort(r.request_id)
        target = 200 + 5 * n
        median_us = statistics.median(times) * 1e6
        row = {
            "n": n,
            "us_per_step_median": round(median_us, 1),
            "us_per_step_mean": round(statistics.fmean(times) * 1e6, 1),
            "us_per_step_min": round(min(times) * 1e6, 1),
            "target_us": target,
            "met": median_us <= target,
            "us_per_request": round(median_us / n, 2),
            "phase_median_us": timer.medians_us(),
            "others_cpu": None if t.others_cpu is None else round(t.others_cpu, 3),
        }
        log(
            f"  N={n:4d}: median {median_us:8.1f} us/step (min {row['us_per_step_min']}), "
            f"target {target} us -> {'MET' if row['met'] else 'missed'}; "
            f"phase medians {row['phase_median_us']}; other processes {row['others_cpu']}"
        )
        results.append(row)
    del llm, engine
    gc.collect()
    return results


def measure(model_dir: Path, vocab: int, w: Workload, wait_quiet_s: float) -> dict[str, Any]:
    """Both variants, vocab-wide first; the summary entry for the JSON."""
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "target_us": "200 + 5 * N"}
    for key, width in (("vocab", vocab), ("narrow", 1)):
        log(
            f"host overhead ({key}): no-op model returning (rows, {width}) zeros, N in "
            f"{list(w.overhead_ns)}, {w.overhead_steps} steps each, "
            f"{torch.get_num_threads()} threads"
        )
        rows = host_overhead(model_dir, vocab, w, logits_width=width, wait_quiet_s=wait_quiet_s)
        out[key] = rows
        out[f"{key}_all_met"] = all(r["met"] for r in rows)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Prints progress to stderr and a one-line JSON summary as the last stdout line.",
    )
    add_common_args(parser)
    args = parser.parse_args(argv)
    s = setup("host_overhead", args)
    s.summary["host_overhead"] = measure(s.model_dir, s.shape.vocab, s.work, args.wait_quiet)
    print_summary(s)


if __name__ == "__main__":
    main()
