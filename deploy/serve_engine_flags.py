"""`tandem serve`'s engine flags, vLLM's names: each sets `engine.<field>` of the config for
both roles (over what the file gives the roles), `--stream-interval` `decode.stream_interval`."""

from __future__ import annotations

from typing import Annotated

import typer

MaxModelLen = Annotated[
    int | None,
    typer.Option(min=2, help="Longest prompt + output in tokens (default: the model's)."),
]
StreamInterval = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Tokens a stream gathers before they go out (default 1: every token at once). "
        "More send fewer, larger chunks: less work per token on the decode worker, the "
        "router and the client, at the cost of coarser streaming.",
    ),
]
Dtype = Annotated[
    str | None,
    typer.Option(
        help="Weights' and KV cache's dtype: auto (default: the checkpoint's), float32, "
        "bfloat16 or float16 (also float, bf16, half, fp16)."
    ),
]
GpuMemoryUtilization = Annotated[
    float | None,
    typer.Option(
        min=0.01,
        max=1.0,
        help="Share of a GPU's memory each engine on it may use for weights, activations "
        "and its KV cache (default 0.9; on a share of a GPU, 0.9 x that share). CPU "
        "engines size their KV cache by engine.kv_cache_memory_gb (1 GiB).",
    ),
]
MaxNumSeqs = Annotated[
    int | None,
    typer.Option(min=1, help="Most requests an engine runs at once (default 256)."),
]
MaxNumBatchedTokens = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Most tokens one engine step computes (default 2048): longer prompts are "
        "prefilled in chunks of it.",
    ),
]
BlockSize = Annotated[
    int | None,
    typer.Option(min=1, max=1024, help="Tokens per KV cache block (default 16)."),
]
EnablePrefixCaching = Annotated[
    bool | None,
    typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV blocks of prompt prefixes seen before (default: on).",
        show_default=False,
    ),
]
Seed = Annotated[
    int | None,
    typer.Option(help="Seed of the engines' sampling for requests that give none (default 0)."),
]
GenerationConfig = Annotated[
    str | None,
    typer.Option(
        help="Where requests' default sampling settings come from: auto (default: the "
        "checkpoint's generation_config.json), vllm or none (none of them), or a folder "
        "holding a generation_config.json."
    ),
]
