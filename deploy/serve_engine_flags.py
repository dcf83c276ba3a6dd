"""`tandem serve`'s engine flags, vLLM's names: each sets `engine.<field>` of the config for
both roles (over what the file gives the roles), `--stream-interval` `decode.stream_interval`."""

from __future__ import annotations

import re
from typing import Annotated

import typer

_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """vLLM's sizes: 32768, 25.6k (k/m/g/t: powers of 1000) or 32K (K/M/G/T: of 1024, whole
    numbers only)."""
    match = _SUFFIXED.fullmatch(text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise typer.BadParameter(
                f"{text!r} is not a whole number (e.g. 32768 or 32K)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise typer.BadParameter(f"{text!r}: a fraction takes k, m, g or t, not {suffix}")
    return int(number) * _BINARY[suffix]


def human_int_or_auto(text: str) -> int | None:
    """`human_int`, or None for vLLM's auto / -1 (the model's length, as fits the KV cache)."""
    return None if text.strip().lower() in ("auto", "-1") else human_int(text)


MaxModelLen = Annotated[
    int | None,
    typer.Option(
        parser=human_int_or_auto,
        metavar="N",
        help="Longest prompt + output in tokens, e.g. 8192 or 32K (default, or auto: the model's).",
    ),
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
        parser=human_int,
        metavar="N",
        help="Most tokens one engine step computes, e.g. 2048 (the default) or 16K: longer "
        "prompts are prefilled in chunks of it.",
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
Tokenizer = Annotated[
    str | None,
    typer.Option(
        metavar="DIR",
        help="A tokenizer's directory (or a Hugging Face repo id the local cache holds) to "
        "use instead of the checkpoint's own, chat template included, as vLLM's --tokenizer.",
    ),
]
