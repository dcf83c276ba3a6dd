"""Engine configuration: one pydantic model, validated before anything is allocated."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.engine.errors import TandemError
from tandem.engine.hub_cache import cached_snapshot
from tandem.engine.model_config import load_model_spec
from tandem.engine.weights import stored_dtype

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEFAULT_KV_CACHE_GB = 1.0
"""The KV pool on the CPU when neither `num_kv_blocks` nor `kv_cache_memory_gb` is set."""
DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16"}


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype a checkpoint's config.json declares, else that of its stored weights (as
    transformers' `dtype="auto"` reads them), as one of `DTYPES` (float32 for another)."""
    try:
        declared = load_model_spec(model_dir).checkpoint_dtype or stored_dtype(Path(model_dir))
    except TandemError:
        return "float32"  # (the engine reports the checkpoint's problem when it loads it)
    declared = DTYPE_ALIASES.get(declared, declared)
    return declared if declared in DTYPES else "float32"


class EngineConfig(BaseModel):
    """Everything an engine (offline `LLM`, prefill worker or decode worker) needs to start.

    `num_kv_blocks=None` sizes the KV pool from `kv_cache_memory_gb` when set; else, on a GPU,
    from `gpu_memory_utilization` (the share of the GPU's memory the engine may use for weights,
    its largest step and the pool; `kv_memory`), and on the CPU 1 GiB. Either way the pool is
    capped at what `max_num_seqs` requests of `max_model_len` tokens could ever use.
    `max_model_len=None` takes the model's context (`max_position_embeddings`, times a linear
    or yarn rope's factor, as vLLM derives it), reduced to what the pool holds when smaller.
    `dtype` of weights and KV cache; "auto" (the default, as in vLLM and transformers 5) takes the
    checkpoint's (config.json's, else the stored weights'), and vLLM's "half" / "float" are accepted.
    `device` places weights and the KV pool ("auto": CUDA when available); `attention_backend`
    "auto" runs the Triton kernels on CUDA and the torch ones on the CPU (`tandem.kernels`).
    `tokenizer`: a directory whose tokenizer (and chat template) is used instead of the
    checkpoint's own, as vLLM's `tokenizer=`; eos ids and sampling defaults still come from the
    checkpoint's generation_config.json.
    `generation_config`: where requests' sampling defaults come from ("auto": the model's
    generation_config.json; "none"/"vllm": none; or a directory; `generation_defaults`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_kv_events: bool = False
    model_revision: str | None = None
    tokenizer: str | None = None
    attention_backend: Literal["auto", "cpu", "triton", "reference"] = "auto"
    device: str = Field("cpu", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    seed: int = 0
    generation_config: str = "auto"

    @model_validator(mode="before")
    @classmethod
    def _resolve_dtype(cls, data: Any) -> Any:
        """vLLM's spellings: "auto" (the checkpoint's dtype; also when none is given), "half",
        "float", ...; a model named by its Hugging Face repo id is the snapshot the Hugging
        Face cache holds (`cached_snapshot`), and so is a tokenizer named so."""
        if isinstance(data, dict):
            for name in ("model", "tokenizer"):
                if isinstance(data.get(name), str):
                    data = {**data, name: cached_snapshot(data[name])}
        raw = data.get("dtype", "auto") if isinstance(data, dict) else None
        if isinstance(raw, str):
            name = DTYPE_ALIASES.get(raw, raw)
            if name == "auto":
                name = checkpoint_dtype(str(data.get("model", "")))
            elif name not in DTYPES:
                spellings = ", ".join(["auto", *DTYPES, *DTYPE_ALIASES])
                raise ValueError(f"dtype {raw!r} is not one of {spellings}")
            data = {**data, "dtype": name}
        return data

    @model_validator(mode="after")
    def _kernels_fit_the_device(self) -> EngineConfig:
        # (on a device left "auto" the kernels may run under Triton's interpreter: tests)
        if self.attention_backend == "triton" and self.device == "cpu":
            raise ValueError("attention_backend 'triton' runs on CUDA only, and device is 'cpu'")
        return self

    def resolved_device(self) -> torch.device:
        """`device` with "auto" resolved (CUDA when available); ValueError when CUDA is asked for
        and absent."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available on this machine")
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
