"""Flags of `vllm serve` that `tandem serve` takes so that a vLLM command line runs as it is:
each either means what vLLM means by it, is what tandem always does, or is refused with why
(a value tandem cannot honour, never silently dropped)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import typer

from tandem.deploy.vllm_arg_forms import dashed, repeat_values, rewriting

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


SwapSpace = Annotated[
    float | None,
    typer.Option(
        metavar="GIB",
        help="Taken for vLLM command lines: tandem swaps no KV cache to the CPU (a request "
        "preempted for room is computed again).",
    ),
]
KvCacheDtype = Annotated[
    str, typer.Option(help="auto only: the KV cache has the weights' dtype (--dtype).")
]
LoadFormat = Annotated[
    str,
    typer.Option(
        help="auto, safetensors or pt: the checkpoint's .safetensors files, else its PyTorch "
        ".bin files."
    ),
]
MaxSeqLenToCapture = Annotated[
    int | None, typer.Option(metavar="N", help="Always so: tandem captures no CUDA graphs.")
]
DisableCustomAllReduce = Annotated[
    bool,
    typer.Option(
        "--disable-custom-all-reduce",
        show_default=False,
        help="Always so: each worker runs on one device (no all-reduce).",
    ),
]
Task = Annotated[str, typer.Option(help="auto or generate only: tandem generates text.")]


def refused_vllm_flags(
    tensor_parallel: int,
    pipeline_parallel: int,
    chunked: bool,
    kv_cache_dtype: str = "auto",
    load_format: str = "auto",
    task: str = "auto",
) -> str | None:
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
    if kv_cache_dtype != "auto":
        return (
            f"--kv-cache-dtype {kv_cache_dtype}: tandem's KV cache has the weights' dtype "
            "(auto; choose it with --dtype)"
        )
    if load_format not in ("auto", "safetensors", "pt"):
        return f"--load-format {load_format}: tandem reads safetensors or pt checkpoints (auto)"
    if task not in ("auto", "generate"):
        return f"--task {task}: tandem serves text generation only (generate)"
    return None


def _vllm_forms(args: list[str]) -> list[str]:
    """vLLM's `--served-model-name a b` (and `--api-key a b`) as the option repeated, where
    the model is given otherwise (first, `--model` or `--config`): a path after the names
    would be taken for one."""
    given = bool(args) and not args[0].startswith("-")
    named = ("--model", "--config")  # (a config file may name it)
    if given or any(dashed(a).partition("=")[0] in named for a in args):
        return repeat_values(args, ("--served-model-name", "--api-key"))
    return args


ServeForms = rewriting(_vllm_forms)
"""`tandem serve`'s command class: it reads vLLM's `--served-model-name a b`, `--api-key a b`."""


def one_or_list(values: list[str] | None) -> str | list[str] | None:
    """A repeatable option's values as the config takes them: one as it is, several as the
    list, none as None."""
    if not values:
        return None
    return values[0] if len(values) == 1 else list(values)


def api_key_option(given: list[str] | None, env: Mapping[str, str]) -> str | list[str] | None:
    """`--api-key`'s keys, else the environment's one key (TANDEM_API_KEY, else vLLM's
    VLLM_API_KEY; as vLLM, a value is one key, spaces and all)."""
    return one_or_list(given) or env.get("TANDEM_API_KEY") or env.get("VLLM_API_KEY") or None
