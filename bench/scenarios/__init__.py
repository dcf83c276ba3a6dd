"""The serving scenarios behind docs/benchmarks.md, run on one machine with small settings.

`python -m bench.scenarios.run_all` runs them in one local Ray cluster and writes the figures
(JSON) and the plots (PNG); see that module for the exact settings.
"""
