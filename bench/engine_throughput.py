"""End-to-end benchmark: tandem offline throughput vs Hugging Face `generate`, and host overhead.

Not a test. Runs on CPU with a ~40M-parameter random Llama checkpoint that it builds (once) under
``.tandem/bench-models/``. Three parts:

1. Throughput: 64 requests, 128-token random prompts, output lengths uniform in [16, 256], greedy,
   ``ignore_eos``. tandem (``LLM.generate``, continuous batching) against transformers
   ``generate`` with static batches of 8 (each batch runs to the longest of its 8 lengths; only
   the requested lengths count as useful tokens). Also an exactness spot check: tandem's greedy
   tokens for the first HF batch against HF's.
2. Host overhead: the model is replaced by a no-op that returns zero logits; N requests in steady
   decode; microseconds per ``engine.step()`` at each N against the target ``200 + 5 * N``.
3. ``--profile``: where tandem's time goes on the throughput workload (engine phases, cProfile
   and torch.profiler top entries), printed to stderr.

Progress goes to stderr; the last stdout line is a JSON summary.

    .venv/bin/python bench/engine_throughput.py [--quick] [--profile] [--repeats N]
        [--skip-tandem] [--skip-hf] [--skip-overhead] [--wait-quiet SECONDS]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import pstats
import random
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.model import AttentionMetadata  # noqa: E402
from tandem.kernels.kv_cache import KVCachePool  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".tandem" / "bench-models"
HF_BATCH = 8

T = TypeVar("T")


# ---- configuration ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 32000
    intermediate: int = 1376
    tie_embeddings: bool = True
    seed: int = 0

    @property
    def dirname(self) -> str:
        tie = "tied" if self.tie_embeddings else "untied"
        return (
            f"llama-l{self.layers}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}"
            f"-i{self.intermediate}-v{self.vocab}-{tie}-s{self.seed}"
        )


@dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    prompt_len: int = 128
    min_out: int = 16
    max_out: int = 256
    overhead_ns: tuple[int, ...] = (1, 16, 64, 256)
    overhead_steps: int = 200
    overhead_prompt_len: int = 16
    profile_max_out: int = 48  # cProfile / torch.profiler runs: every request, outputs capped


FULL = (ModelShape(), Workload())
QUICK = (
    ModelShape(layers=2),
    Workload(
        num_requests=16, max_out=64, overhead_ns=(1, 16, 64), overhead_steps=50, profile_max_out=16
    ),
)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- checkpoint -------------------------------------------------------------------------------
def ensure_checkpoint(cache_dir: Path, shape: ModelShape) -> Path:
    """Builds the checkpoint into ``cache_dir/<shape>`` unless it is already there."""
    target = cache_dir / shape.dirname
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        log(f"checkpoint cached: {target}")
        return target
    from tandem.deploy.tiny_model import build_tiny_checkpoint

    log(f"building checkpoint {target} ...")
    tmp = cache_dir / f".{shape.dirname}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tiny_checkpoint(
        tmp,
        arch="llama",
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        vocab=shape.vocab,
        intermediate=shape.intermediate,
        tie_embeddings=shape.tie_embeddings,
        seed=shape.seed,
    )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def count_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            total += math.prod(f.get_slice(name).get_shape())
    return total


# ---- workload ---------------------------------------------------------------------------------
def make_workload(w: Workload, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (ids 3.. to stay clear of the special tokens) and output lengths."""
    len_rng = random.Random(0)
    lengths = [len_rng.randint(w.min_out, w.max_out) for _ in range(w.num_requests)]
    prompt_rng = random.Random(1)
    prompts = [
        [prompt_rng.randrange(3, vocab) for _ in range(w.prompt_len)] for _ in range(w.num_requests)
    ]
    return prompts, lengths


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def system_busy(interval: float = 0.5) -> float | None:
    """Fraction of all CPUs busy over `interval` seconds (Linux /proc/stat), None elsewhere."""

    def read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    a = read()
    time.sleep(interval)
    b = read()
    if a is None or b is None or b[0] == a[0]:
        return None
    return 1.0 - (b[1] - a[1]) / (b[0] - a[0])


def wait_for_quiet(max_wait_s: float, threshold: float = 0.15) -> None:
    """Waits (at most `max_wait_s`) until other processes leave the CPUs idle for two samples
    in a row: on a shared 2-core box a concurrent job slows 2-thread torch by up to 10x."""
    if max_wait_s <= 0:
        return
    deadline = time.monotonic() + max_wait_s
    quiet = 0
    busy: float | None = None
    while time.monotonic() < deadline:
        busy = system_busy()
        if busy is None:
            return
        quiet = quiet + 1 if busy < threshold else 0
        if quiet >= 2:
            return
    log(f"  CPUs still busy ({busy:.0%}) after waiting {max_wait_s:.0f} s; measuring anyway")


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    t = os.times()
    return t.user + t.system


# ---- 1. throughput ----------------------------------------------------------------------------
@dataclass
class TandemResult:
    tok_s: float
    generated_tokens: int
    wall_s: float
    steps: int
    outputs: list[list[int]]
    cached_tokens: int
    cpu_share: float  # process CPU time / (wall * threads); well below 1 means CPU contention


def run_tandem(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> TandemResult:
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()  # repeats must not hit the previous run's prompts
    counter = _StepCounter(engine)
    gc.collect()
    c0, t0 = cpu_seconds(), time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for n in lengths])
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    counter.restore()
    generated = sum(len(o.token_ids) for o in outs)
    return TandemResult(
        tok_s=generated / wall,
        generated_tokens=generated,
        wall_s=wall,
        steps=counter.steps,
        outputs=[list(o.token_ids) for o in outs],
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        cpu_share=cpu / (wall * torch.get_num_threads()),
    )


class _StepCounter:
    """Counts engine steps by wrapping the bound `step` on the instance (negligible cost)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps = 0
        inner = engine.step

        def step() -> Any:
            self.steps += 1
            return inner()

        engine.step = step  # type: ignore[method-assign]

    def restore(self) -> None:
        del self.engine.step


@dataclass
class HFResult:
    tok_s: float
    useful_tokens: int
    computed_tokens: int
    wall_s: float
    first_batch: list[list[int]]
    cpu_share: float


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32
    )
    model.eval()
    gc_ = model.generation_config
    gc_.eos_token_id = None
    gc_.pad_token_id = 0
    gc_.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(gc_, name):
            setattr(gc_, name, None)
    return model


def hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    ids = torch.tensor(prompts, dtype=torch.int64)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    assert out.shape == (len(prompts), ids.shape[1] + max_new_tokens), out.shape
    return out[:, ids.shape[1] :]


def run_hf(model: Any, prompts: list[list[int]], lengths: list[int]) -> HFResult:
    useful = computed = 0
    first: list[list[int]] = []
    gc.collect()
    c0, t0 = cpu_seconds(), time.perf_counter()
    for b in range(0, len(prompts), HF_BATCH):
        batch_lens = lengths[b : b + HF_BATCH]
        new = hf_generate(model, prompts[b : b + HF_BATCH], max(batch_lens))
        useful += sum(batch_lens)
        computed += max(batch_lens) * len(batch_lens)
        if b == 0:
            first = [new[i, :n].tolist() for i, n in enumerate(batch_lens)]
        log(
            f"  hf batch {b // HF_BATCH + 1}/{math.ceil(len(prompts) / HF_BATCH)} done ({time.perf_counter() - t0:.1f}s)"
        )
    wall = time.perf_counter() - t0
    share = (cpu_seconds() - c0) / (wall * torch.get_num_threads())
    return HFResult(useful / wall, useful, computed, wall, first, share)


def exactness(tandem_first: list[list[int]], hf_first: list[list[int]]) -> dict[str, Any]:
    mismatched = []
    for i, (a, b) in enumerate(zip(tandem_first, hf_first, strict=True)):
        if a != b:
            pos = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            mismatched.append({"request": i, "first_diff_at": pos, "len": len(b)})
    return {
        "exact": not mismatched,
        "requests_checked": len(hf_first),
        "mismatched_requests": len(mismatched),
        "mismatches": mismatched,
    }


# ---- 2. host overhead -------------------------------------------------------------------------
class NoOpModel:
    """Stands in for the model: zero logits for the rows to sample, no compute, no KV writes."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVCachePool,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        return torch.zeros(len(logits_indices), self.vocab)


class PhaseTimer:
    """Wraps engine parts with perf_counter timers: schedule, prepare, model, sample, process,
    advance. Instance attributes shadow the methods; `restore` removes them. Every call's
    duration is kept, and for the model also its batch shape (tokens, rows sampled)."""

    PHASES = ("schedule", "prepare", "model", "sample", "process", "advance")

    def __init__(self, engine: LLMEngine) -> None:
        import tandem.engine.llm_engine as llm_engine_mod

        self.engine = engine
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.model_shapes: list[tuple[int, int]] = []  # (tokens in the batch, rows sampled)
        self._mod = llm_engine_mod
        self._orig_sample = llm_engine_mod.sample
        self._orig_model = engine.runner.model
        sched, runner, proc = engine.scheduler, engine.runner, engine.output_processor
        sched.schedule = self._wrap("schedule", sched.schedule)  # type: ignore[method-assign]
        sched.advance = self._wrap("advance", sched.advance)  # type: ignore[method-assign]
        runner.prepare = self._wrap("prepare", runner.prepare)  # type: ignore[method-assign]
        proc.process = self._wrap("process", proc.process)  # type: ignore[method-assign]
        llm_engine_mod.sample = self._wrap("sample", llm_engine_mod.sample)
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
        self._mod.sample = self._orig_sample


@contextmanager
def phase_timer(engine: LLMEngine) -> Iterator[PhaseTimer]:
    timer = PhaseTimer(engine)
    try:
        yield timer
    finally:
        timer.restore()


def _steady(engine: LLMEngine, n: int) -> bool:
    s = engine.scheduler
    return (
        not s.waiting
        and len(s.running) == n
        and all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)
    )


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


def host_overhead(
    model_dir: Path,
    vocab: int,
    w: Workload,
    *,
    logits_width: int,
    warm_steps: int = 20,
    wait_quiet_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Steady-decode `engine.step()` time with a no-op model returning (rows, logits_width) zeros.

    Per N: add N requests (random 16-token prompts, max_tokens far away), step until all are in
    steady decode, `warm_steps` more, then time `overhead_steps` steps (clean), then the same
    number again under `PhaseTimer` for the per-phase medians. The requests are then aborted.
    """
    bs = 16
    max_n = max(w.overhead_ns)
    tokens_per_req = w.overhead_prompt_len + 2 * (warm_steps + w.overhead_steps) + 64
    num_blocks = max_n * math.ceil(tokens_per_req / bs) + 64
    max_tokens = 1500  # never reached: the requests are aborted after timing
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=bs,
        num_kv_blocks=num_blocks,
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
                [rng.randrange(3, vocab) for _ in range(w.overhead_prompt_len)], greedy(max_tokens)
            )
            for _ in range(n)
        ]
        guard = 0
        while not _steady(engine, n):
            engine.step()
            guard += 1
            if guard > 1000:
                raise RuntimeError(f"N={n}: requests never reached steady decode")
        for _ in range(warm_steps):
            engine.step()
        assert _steady(engine, n)
        wait_for_quiet(wait_quiet_s)
        gc.collect()
        times = _timed_steps(engine, n, w.overhead_steps)
        with phase_timer(engine) as timer:
            _timed_steps(engine, n, w.overhead_steps)
        for r in reqs:
            engine.abort(r.request_id)
        target = 200 + 5 * n
        median_us = statistics.median(times) * 1e6
        phases = timer.medians_us()
        row = {
            "n": n,
            "us_per_step_median": round(median_us, 1),
            "us_per_step_mean": round(statistics.fmean(times) * 1e6, 1),
            "us_per_step_min": round(min(times) * 1e6, 1),
            "target_us": target,
            "met": median_us <= target,
            "us_per_request": round(median_us / n, 2),
            "phase_median_us": phases,
        }
        log(
            f"  N={n:4d}: median {median_us:8.1f} us/step (min {row['us_per_step_min']}), "
            f"target {target} us -> {'MET' if row['met'] else 'missed'}; phase medians {phases}"
        )
        results.append(row)
    del llm, engine
    gc.collect()
    return results


# ---- 3. profile -------------------------------------------------------------------------------
@dataclass
class ProfileReport:
    wall_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    phases_pct: dict[str, float] = field(default_factory=dict)
    model_steps: dict[str, Any] = field(default_factory=dict)
    cprofile_top: list[str] = field(default_factory=list)
    torch_ops_top: list[dict[str, Any]] = field(default_factory=list)
    decode_step_ops: list[dict[str, Any]] = field(default_factory=list)


def _model_step_summary(timer: PhaseTimer) -> dict[str, Any]:
    """Model time split into steps with prefill tokens and decode-only steps by batch size."""
    rows = list(zip(timer.model_shapes, timer.durations["model"], strict=True))
    prefill = [(s, d) for s, d in rows if s[0] != s[1]]
    decode = [(s, d) for s, d in rows if s[0] == s[1]]
    summary: dict[str, Any] = {
        "prefill_steps": len(prefill),
        "prefill_tokens": sum(s[0] for s, _ in prefill),
        "prefill_model_s": round(sum(d for _, d in prefill), 3),
        "decode_steps": len(decode),
        "decode_tokens": sum(s[0] for s, _ in decode),
        "decode_model_s": round(sum(d for _, d in decode), 3),
    }
    buckets: dict[str, Any] = {}
    for lo, hi in ((1, 8), (9, 16), (17, 32), (33, 48), (49, 64), (65, 256)):
        sel = [d for s, d in decode if lo <= s[0] <= hi]
        if sel:
            mean_b = statistics.fmean(s[0] for s, _ in decode if lo <= s[0] <= hi)
            buckets[f"{lo}-{hi}"] = {
                "steps": len(sel),
                "mean_batch": round(mean_b, 1),
                "median_model_ms": round(statistics.median(sel) * 1e3, 2),
                "ms_per_token": round(statistics.median(sel) * 1e3 / mean_b, 3),
            }
    summary["decode_by_batch"] = buckets
    if prefill:
        summary["prefill_ms_per_token"] = round(
            1e3 * summary["prefill_model_s"] / max(1, summary["prefill_tokens"]), 3
        )
    return summary


def profile_tandem(
    llm: LLM,
    prompts: list[list[int]],
    lengths: list[int],
    max_out: int,
    *,
    wait_quiet_s: float = 0.0,
    top: int = 25,
) -> ProfileReport:
    report = ProfileReport()
    engine = llm.engine

    log("profile 1/4: engine phases over the full throughput workload")
    engine.block_manager.reset_prefix_cache()
    wait_for_quiet(wait_quiet_s)
    with phase_timer(engine) as timer:
        t0 = time.perf_counter()
        llm.generate(prompts, [greedy(n) for n in lengths])
        report.wall_s = round(time.perf_counter() - t0, 3)
    phases = timer.totals
    phases["other (step glue, generate loop)"] = report.wall_s - sum(phases.values())
    report.phases_s = {k: round(v, 3) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}
    report.phases_pct = {k: round(100 * v / report.wall_s, 1) for k, v in report.phases_s.items()}
    report.model_steps = _model_step_summary(timer)
    lines = [
        f"    {k:36s} {v:8.3f} s  {report.phases_pct[k]:5.1f}%" for k, v in report.phases_s.items()
    ]
    log(
        f"phase breakdown (wall {report.wall_s:.2f} s, {len(timer.durations['model'])} steps):\n"
        + "\n".join(lines)
        + "\n    model steps: "
        + json.dumps(report.model_steps)
    )

    # All requests (so decode batches are as wide as in the timed run), shorter outputs.
    sub_p, sub_l = prompts, [min(n, max_out) for n in lengths]
    log(f"profile 2/4: cProfile over {len(sub_p)} requests, outputs capped at {max_out}")
    engine.block_manager.reset_prefix_cache()
    wait_for_quiet(wait_quiet_s)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(sub_p, [greedy(n) for n in sub_l])
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    log("cProfile, top by tottime:\n" + buf.getvalue())
    report.cprofile_top = _cprofile_rows(stats, 15)

    log(f"profile 3/4: torch.profiler over the same {len(sub_p)} requests")
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine.block_manager.reset_prefix_cache()
    wait_for_quiet(wait_quiet_s)
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as tp:
        llm.generate(sub_p, [greedy(n) for n in sub_l])
    averages = tp.key_averages()
    log(
        "torch.profiler, top by self CPU time:\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=top)
    )
    by_shape = tp.key_averages(group_by_input_shape=True)
    log(
        "torch.profiler, top by self CPU time, by input shape:\n"
        + by_shape.table(sort_by="self_cpu_time_total", row_limit=top)
    )
    total_self = sum(e.self_cpu_time_total for e in averages) or 1.0
    rows = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:15]
    report.torch_ops_top = [
        {
            "op": e.key,
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1),
            "pct": round(100 * e.self_cpu_time_total / total_self, 1),
            "calls": e.count,
        }
        for e in rows
    ]
    report.decode_step_ops = profile_decode_steps(llm, prompts, wait_quiet_s=wait_quiet_s)
    return report


def profile_decode_steps(
    llm: LLM,
    prompts: list[list[int]],
    *,
    warm_steps: int = 60,
    steps: int = 20,
    wait_quiet_s: float = 0.0,
    top: int = 16,
) -> list[dict[str, Any]]:
    """torch.profiler over `steps` steady decode steps with every prompt in the batch (after
    `warm_steps` steps, i.e. the prefill plus some decode), grouped by op and input shape.
    Returns the top entries in ms per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    n = len(prompts)
    reqs = [engine.add_request(p, greedy(warm_steps + steps + 100)) for p in prompts]
    for _ in range(warm_steps):
        engine.step()
    if not _steady(engine, n):
        raise RuntimeError("decode profile: the batch is not in steady decode yet")
    ctx = statistics.fmean(r.num_tokens for r in reqs)
    log(f"profile 4/4: torch.profiler over {steps} decode steps, batch {n}, mean context {ctx:.0f}")
    wait_for_quiet(wait_quiet_s)
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as tp:
        for _ in range(steps):
            engine.step()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    for r in reqs:
        engine.abort(r.request_id)
    by_shape = sorted(
        tp.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total
    )
    total = sum(e.self_cpu_time_total for e in by_shape) or 1.0
    rows = [
        {
            "op": e.key,
            "shapes": str(e.input_shapes)[:100],
            "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2),
            "pct": round(100 * e.self_cpu_time_total / total, 1),
            "calls_per_step": round(e.count / steps, 1),
        }
        for e in by_shape[:top]
    ]
    by_op = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    lines = [
        f"    {r['op']:50s} {r['ms_per_step']:7.2f} ms/step {r['pct']:5.1f}%  "
        f"x{r['calls_per_step']:<5} {r['shapes']}"
        for r in rows
    ]
    op_lines = [
        f"    {e.key:50s} {e.self_cpu_time_total / 1e3 / steps:7.2f} ms/step "
        f"{100 * e.self_cpu_time_total / total:5.1f}%"
        for e in by_op
    ]
    log(
        f"decode step (batch {n}, context ~{ctx:.0f}): {wall_ms:.1f} ms/step under the profiler; "
        f"by op and shape:\n" + "\n".join(lines) + "\n  by op:\n" + "\n".join(op_lines)
    )
    rows.insert(
        0, {"op": "(step wall under profiler)", "ms_per_step": round(wall_ms, 2), "batch": n}
    )
    return rows


def _cprofile_rows(stats: pstats.Stats, top: int) -> list[str]:
    entries: Sequence[tuple[Any, Any]] = sorted(
        stats.stats.items(),  # type: ignore[attr-defined]
        key=lambda kv: -kv[1][2],
    )[:top]
    rows = []
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in entries:
        rows.append(f"{func} ({filename}:{line}) calls={nc} tottime={tt:.3f}s cumtime={ct:.3f}s")
    return rows


def tandem_throughput(
    llm: LLM,
    prompts: list[list[int]],
    lengths: list[int],
    repeats: int,
    wait_quiet_s: float,
    summary: dict[str, Any],
) -> TandemResult:
    """`repeats` timed runs; the best goes into `summary["tandem"]` and is returned."""
    runs: list[TandemResult] = []
    for i in range(repeats):
        log(f"tandem: generating {len(prompts)} requests (run {i + 1}/{repeats})")
        wait_for_quiet(wait_quiet_s)
        runs.append(run_tandem(llm, prompts, lengths))
        r = runs[-1]
        log(
            f"tandem: {r.generated_tokens} tokens in {r.wall_s:.2f} s over {r.steps} steps = "
            f"{r.tok_s:.1f} tok/s (prefix-cache hits {r.cached_tokens} tokens; "
            f"cpu share {r.cpu_share:.2f}, load {os.getloadavg()[0]:.2f})"
        )
    best = max(runs, key=lambda r: r.tok_s)
    summary["tandem"] = {
        "tok_s": round(best.tok_s, 1),
        "generated_tokens": best.generated_tokens,
        "wall_s": round(best.wall_s, 3),
        "steps": best.steps,
        "prefix_cache_hit_tokens": best.cached_tokens,
        "all_tok_s": [round(r.tok_s, 1) for r in runs],
        "cpu_share": [round(r.cpu_share, 2) for r in runs],
    }
    if best.generated_tokens != sum(lengths):
        log(f"WARNING: tandem generated {best.generated_tokens} tokens, expected {sum(lengths)}")
    return best


# ---- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Prints progress to stderr and a one-line JSON summary as the last stdout line.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 16 requests, lengths [16, 64], 2 layers"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile tandem (phases, cProfile, torch)"
    )
    parser.add_argument(
        "--skip-tandem",
        action="store_true",
        help="skip the timed tandem runs (no ratio / exactness; --profile still runs)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument(
        "--skip-overhead", action="store_true", help="skip the no-op-model host overhead part"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument(
        "--overhead-threads",
        type=int,
        default=None,
        help="torch threads for the host-overhead part (default: --threads)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs of tandem and of HF each; the best (highest tok/s) is reported",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="before each timed run, wait up to this long for other processes to leave the CPUs "
        "idle (0: never wait; default 60)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help="where checkpoints are kept"
    )
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    shape, work = QUICK if args.quick else FULL
    model_dir = ensure_checkpoint(args.cache_dir, shape)
    num_params = count_parameters(model_dir)
    log(
        f"model: {shape.dirname}, {num_params / 1e6:.2f}M parameters; torch threads {torch.get_num_threads()}"
    )
    prompts, lengths = make_workload(work, shape.vocab)
    summary: dict[str, Any] = {
        "bench": "engine_throughput",
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "model": {**asdict(shape), "parameters": num_params},
        "workload": {
            "requests": work.num_requests,
            "prompt_len": work.prompt_len,
            "output_len_range": [work.min_out, work.max_out],
            "requested_output_tokens": sum(lengths),
            "hf_batch": HF_BATCH,
        },
    }

    # 1. tandem throughput
    tres: TandemResult | None = None
    if not args.skip_tandem or args.profile:
        log("tandem: loading")
        llm = LLM(
            model=str(model_dir), dtype="float32", max_num_seqs=256, max_num_batched_tokens=2048
        )
        warm_rng = random.Random(3)
        warm_prompts = [[warm_rng.randrange(3, shape.vocab) for _ in range(32)] for _ in range(4)]
        llm.generate(warm_prompts, greedy(8))
        if not args.skip_tandem:
            tres = tandem_throughput(llm, prompts, lengths, args.repeats, args.wait_quiet, summary)
        if args.profile:
            report = profile_tandem(
                llm, prompts, lengths, work.profile_max_out, wait_quiet_s=args.wait_quiet
            )
            summary["profile"] = asdict(report)
        del llm
        gc.collect()

    # HF baseline
    if not args.skip_hf:
        log("hf: loading")
        hf_model = load_hf(model_dir)
        hf_generate(hf_model, prompts[:2], 4)  # warm-up
        hruns: list[HFResult] = []
        for i in range(args.repeats):
            log(
                f"hf: generating {work.num_requests} requests in static batches of {HF_BATCH} (run {i + 1})"
            )
            wait_for_quiet(args.wait_quiet)
            hruns.append(run_hf(hf_model, prompts, lengths))
            h = hruns[-1]
            log(
                f"hf: {h.useful_tokens} useful tokens ({h.computed_tokens} computed) in "
                f"{h.wall_s:.2f} s = {h.tok_s:.1f} tok/s (cpu share {h.cpu_share:.2f}, "
                f"load {os.getloadavg()[0]:.2f})"
            )
        hres = max(hruns, key=lambda r: r.tok_s)
        summary["hf"] = {
            "tok_s": round(hres.tok_s, 1),
            "useful_tokens": hres.useful_tokens,
            "computed_tokens": hres.computed_tokens,
            "wall_s": round(hres.wall_s, 3),
            "all_tok_s": [round(r.tok_s, 1) for r in hruns],
            "cpu_share": [round(r.cpu_share, 2) for r in hruns],
        }
        if tres is not None:
            check = exactness(tres.outputs[:HF_BATCH], hres.first_batch)
            log(f"exactness (first HF batch): {check}")
            ratio = tres.tok_s / hres.tok_s
            log(f"ratio tandem/hf = {ratio:.2f} (target >= 4)")
            summary["ratio"] = round(ratio, 2)
            summary["ratio_target"] = 4.0
            summary["ratio_met"] = ratio >= 4.0
            summary["exactness"] = check
        del hf_model
        gc.collect()

    # 2. host overhead
    if not args.skip_overhead:
        threads = args.overhead_threads or args.threads
        torch.set_num_threads(threads)
        summary["host_overhead_threads"] = threads
        for key, width in (("host_overhead", shape.vocab), ("host_overhead_narrow", 1)):
            log(
                f"host overhead: no-op model returning (rows, {width}) zeros, N in "
                f"{list(work.overhead_ns)}, {work.overhead_steps} steps each, {threads} threads"
            )
            rows = host_overhead(
                model_dir, shape.vocab, work, logits_width=width, wait_quiet_s=args.wait_quiet
            )
            summary[key] = rows
            summary[f"{key}_all_met"] = all(r["met"] for r in rows)
        torch.set_num_threads(args.threads)

    summary["loadavg_start"] = [round(x, 2) for x in load_start]
    summary["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summary["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
