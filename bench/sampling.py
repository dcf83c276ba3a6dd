"""The sampler's host cost per step: tandem's `sample()` against the same filters done the
usual torch way (a sort of the whole vocabulary for top-k and top-p, `torch.multinomial`).

Rows are Zipf-like logits (as a trained model's: the 0.9 nucleus holds a few dozen tokens) for
vocabularies of 32k and 152k tokens, 1 and 16 rows, every request at temperature 0.8, top-k 50
and top-p 0.9 (`k50_p0.9`, as Qwen's defaults have both), then at temperature 0.6 and top-p
0.9 alone (`p0.9`, Llama's), then at temperature 1.0 and min-p 0.05 alone (`minp0.05`). On a CPU worker this is paid per decode step; on a GPU worker
the filters run on the GPU (only the draws are made on the host). Prints a JSON summary as the
last line::

    .venv/bin/python bench/sampling.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tandem.engine.request import Request  # noqa: E402
from tandem.engine.sampler import _top_p_sorted, sample  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402

PARAMS = {
    "k50_p0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=8),
    "p0.9": SamplingParams(temperature=0.6, top_p=0.9, max_tokens=8),
    "minp0.05": SamplingParams(temperature=1.0, min_p=0.05, max_tokens=8),
}


VOCABS = (32_000, 152_000)


def _tandem_way(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return sample(logits.clone(), requests)  # (it changes the logits it is given in place)


def sorted_torch_way(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """Temperature, min-p, top-k and top-p by sorting each row, then `torch.multinomial`."""
    scaled = logits / params.temperature
    if params.min_p > 0:
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * params.min_p
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if params.top_k > 0:
        kth = scaled.sort(dim=-1, descending=True).values[:, params.top_k - 1 : params.top_k]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        scaled = _top_p_sorted(scaled, torch.full((len(scaled),), params.top_p))
    return torch.multinomial(scaled.softmax(dim=-1), 1).flatten().tolist()


def zipf_rows(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = -1.5 * torch.arange(1, vocab + 1, dtype=torch.float32).log()
    return torch.stack([ranks[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (workers use 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, dict[str, float]] = {}
    for (name, params), vocab, rows in itertools.product(PARAMS.items(), VOCABS, (1, 16)):
        logits = zipf_rows(rows, vocab)
        requests = [Request(f"r{i}", [1, 2, 3], params, frozenset()) for i in range(rows)]
        tandem_ms = median_ms(functools.partial(_tandem_way, logits, requests), args.repeats)
        torch_way = functools.partial(sorted_torch_way, logits, params)
        torch_ms = median_ms(torch_way, args.repeats)
        key = f"{name}_vocab{vocab // 1000}k_rows{rows}"
        results[key] = {
            "tandem_ms": round(tandem_ms, 3),
            "sort_and_multinomial_ms": round(torch_ms, 3),
            "speedup": round(torch_ms / tandem_ms, 1),
        }
        print(
            f"[bench] {key}: tandem {tandem_ms:.2f} ms, sort + multinomial "
            f"{torch_ms:.2f} ms ({torch_ms / tandem_ms:.1f}x)",
            file=sys.stderr,
        )
    print(json.dumps({"bench": "sampling", "threads": args.threads, "per_step": results}))


if __name__ == "__main__":
    main()
