"""Flags of `vllm serve` that `tandem serve` takes so that a vLLM command line runs as it is:
each either means what vLLM means by it, is what tandem always does, or is refused with why
(a value tandem cannot honour, never silently dropped)."""

from __future__ import annotations

from typing import Annotated

import typer

TensorParallelSize = Annotated[
    int,
    typer.Option(
        "--tensor-parallel-size",
        "-tp",
        min=1,
        help="1 only: each worker runs the whole model on one device (scale out with "
        "--prefill-replicas / --decode-replicas).",
    ),
]
PipelineParallelSize = Annotated[
    int,
    typer.Option(
        "--pipeline-parallel-size",
        "-pp",
        min=1,
        help="1 only: each worker runs every layer of the model.",
    ),
]
EnableChunkedPrefill = Annotated[
    bool,
    typer.Option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill",
        help="Always on: prompts are prefilled in chunks of --max-num-batched-tokens and each "
        "chunk's KV pages stream to decode as it ends. For whole prompts in one step, raise "
        "--max-num-batched-tokens to the context length instead.",
    ),
]
EnableAutoToolChoice = Annotated[
    bool,
    typer.Option(
        "--enable-auto-tool-choice",
        show_default=False,
        help="Always on: with tool_choice auto the reply's tool calls are read in "
        "--tool-call-parser's format.",
    ),
]
TrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        show_default=False,
        help="Taken for vLLM command lines: tandem runs its own implementation of the "
        "architectures it serves (Llama, Qwen2, Qwen3, Mistral), never a checkpoint's code.",
    ),
]
EnforceEager = Annotated[
    bool,
    typer.Option(
        "--enforce-eager", show_default=False, help="Always so: tandem captures no CUDA graphs."
    ),
]
EnableLogRequests = Annotated[
    bool | None,
    typer.Option(
        "--enable-log-requests/--disable-log-requests",
        help="The router's log line per finished request, with its stage timings "
        "(default: on; the config's router.log_requests).",
        show_default=False,
    ),
]
DisableLogStats = Annotated[
    bool,
    typer.Option(
        "--disable-log-stats",
        show_default=False,
        help="Always so: tandem writes no periodic stats lines (its figures are on /metrics).",
    ),
]


def refused_vllm_flags(tensor_parallel: int, pipeline_parallel: int, chunked: bool) -> str | None:
    """Why the vLLM flags given cannot be honoured (None: they can)."""
    if tensor_parallel > 1 or pipeline_parallel > 1:
        return (
            f"--tensor-parallel-size {tensor_parallel} --pipeline-parallel-size "
            f"{pipeline_parallel}: tandem runs each worker on one device (1 and 1); scale out "
            "with --prefill-replicas / --decode-replicas"
        )
    if not chunked:
        return (
            "--no-enable-chunked-prefill: tandem always prefills in chunks (each chunk's KV "
            "pages stream to decode as it ends); raise --max-num-batched-tokens to the "
            "context length to prefill a whole prompt in one step"
        )
    return None
