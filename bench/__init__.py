"""Benchmarks (not tests), also the `tandem.bench` package (`tandem/bench -> ../bench`).

- `serving/`: the `tandem bench serve` load generator (vLLM-compatible metrics and JSON).
- `scenarios/`: the serving scenarios behind docs/benchmarks.md (mixed traffic, goodput sweep,
  decode throughput), with plots.
- The other modules are entry scripts that print a one-line JSON summary as their last stdout
  line. Run them as scripts (``python bench/engine_throughput.py``) or as modules (``python -m
  bench.engine_throughput``) from the repository root; see docs/benchmarks.md.
"""
