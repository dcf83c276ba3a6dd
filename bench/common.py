"""Shared by the engine benchmarks: model shape and workload, the benchmark checkpoint, waiting for
quiet CPUs, CPU-share accounting, logging, and the command-line options every entry script takes.

Import this module before ``tandem`` or ``transformers``: it sets ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

from tandem import SamplingParams  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".tandem" / "bench-models"
DTYPES = ("float32", "bfloat16")


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
    max_position: int = 2048

    @property
    def dirname(self) -> str:
        tie = "tied" if self.tie_embeddings else "untied"
        ctx = "" if self.max_position == 2048 else f"-ctx{self.max_position}"
        return (
            f"llama-l{self.layers}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}"
            f"-i{self.intermediate}-v{self.vocab}-{tie}-s{self.seed}{ctx}"
        )


@dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    prompt_len: int = 128
    min_out: int = 16
    max_out: int = 256
    hf_batch: int = 8
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


# ---- checkpoint and workload -------------------------------------------------------------------
def ensure_checkpoint(cache_dir: Path, shape: ModelShape) -> Path:
    """Builds the random fp32 checkpoint into ``cache_dir/<shape>`` unless it is already there."""
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
        max_position=shape.max_position,
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


# ---- a shared 2-core machine -------------------------------------------------------------------
def _cpu_jiffies() -> tuple[int, int] | None:
    """(total, idle + iowait) jiffies over all CPUs since boot, from /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)


def _busy_between(a: tuple[int, int] | None, b: tuple[int, int] | None) -> float | None:
    """Fraction of all CPUs busy between two `_cpu_jiffies` readings."""
    if a is None or b is None or b[0] == a[0]:
        return None
    return 1.0 - (b[1] - a[1]) / (b[0] - a[0])


def system_busy(interval: float = 0.5) -> float | None:
    """Fraction of all CPUs busy over `interval` seconds (all processes), None off Linux."""
    a = _cpu_jiffies()
    time.sleep(interval)
    return _busy_between(a, _cpu_jiffies())


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


# /proc/stat counts in jiffies (10 ms): over shorter blocks the contention estimate is noise.
MIN_ACCOUNTED_S = 0.5


@dataclass
class Timing:
    wall_s: float = 0.0
    # Process CPU time / (wall * threads). Close to 1 is necessary, not sufficient, for a clean
    # run: OpenMP threads that spin while waiting for a descheduled peer still burn CPU time.
    cpu_share: float = 0.0
    # CPU time of all other processes / (wall * CPUs), from /proc/stat: the direct measure of
    # contention. None off Linux, and for blocks shorter than `MIN_ACCOUNTED_S`.
    others_cpu: float | None = None


@contextmanager
def timed() -> Iterator[Timing]:
    """Measures the wall time and the CPU accounting of the block (filled in when it exits)."""
    timing = Timing()
    t, j0 = os.times(), _cpu_jiffies()
    c0, t0 = t.user + t.system, time.perf_counter()
    yield timing
    wall = timing.wall_s = time.perf_counter() - t0
    t, busy = os.times(), _busy_between(j0, _cpu_jiffies())
    cpu = t.user + t.system - c0
    timing.cpu_share = cpu / (wall * torch.get_num_threads()) if wall else 0.0
    ncpu = os.cpu_count() or 1
    if busy is not None and wall >= MIN_ACCOUNTED_S:
        timing.others_cpu = max(0.0, busy - cpu / (wall * ncpu))


# ---- command line and summary ------------------------------------------------------------------
def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Options every entry script takes: --quick, --threads, --wait-quiet, --cache-dir."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2-layer model, 16 requests with outputs in [16, 64], N up to 64",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
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


def dtype_list(choice: str) -> list[str]:
    """``--dtype`` value (float32, bfloat16 or both) as a list of engine dtype names."""
    return list(DTYPES) if choice == "both" else [choice]


@dataclass
class Setup:
    shape: ModelShape
    work: Workload
    model_dir: Path
    summary: dict[str, Any]  # the JSON summary so far: machine, model, workload
    t_start: float
    load_start: tuple[float, float, float]


def setup(name: str, args: argparse.Namespace) -> Setup:
    """Sets torch threads, builds or finds the checkpoint, and starts the JSON summary."""
    t_start, load_start = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(args.threads)
    shape, work = QUICK if args.quick else FULL
    model_dir = ensure_checkpoint(args.cache_dir, shape)
    num_params = count_parameters(model_dir)
    log(
        f"model: {shape.dirname}, {num_params / 1e6:.2f}M parameters; "
        f"torch threads {torch.get_num_threads()}"
    )
    summary: dict[str, Any] = {
        "bench": name,
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "model": {**asdict(shape), "parameters": num_params},
    }
    return Setup(shape, work, model_dir, summary, t_start, load_start)


def print_summary(s: Setup) -> None:
    """Adds load averages and the total time, then prints the summary as the last stdout line."""
    s.summary["loadavg_start"] = [round(x, 2) for x in s.load_start]
    s.summary["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    s.summary["total_s"] = round(time.perf_counter() - s.t_start, 1)
    print(json.dumps(s.summary), flush=True)
