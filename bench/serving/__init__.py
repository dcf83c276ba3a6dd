"""`tandem bench serve`: an open-loop serving benchmark for any OpenAI-compatible server.

It speaks `vllm bench serve`'s language: the same metric definitions (TTFT, TPOT, ITL, E2EL,
goodput) and the same keys in the saved JSON, so tools written for vLLM results read ours.

- `records`: what the client saw of one request (chunk arrival times) -> TTFT, ITL, E2EL.
- `metrics`: pure functions from records to the summary metrics.
- `prompts`, `datasets`: the workloads (random, shared-prefix, multi-turn, mixed).
- `client`: one streamed `/v1/completions` request; `runner`: arrivals, concurrency, progress.
- `result`: the vLLM-keyed JSON and the printed summary; `cli`: the typer command.
"""
