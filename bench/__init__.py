"""Benchmarks (not tests). Each entry script prints a one-line JSON summary as its last stdout line.

Run them as scripts (``python bench/engine_throughput.py``) or as modules
(``python -m bench.engine_throughput``); see docs/benchmarks.md.
"""
