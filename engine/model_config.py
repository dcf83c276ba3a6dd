"""What tandem needs to know about a Hugging Face checkpoint, read from its config.json.

Parsing the JSON directly (rather than through transformers' config classes) keeps start-up fast
and makes every supported field explicit: anything we do not implement is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.errors import CheckpointError, UnsupportedModelError

ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""The architecture transformers' `AutoModelForCausalLM` loads for a config.json's `model_type`
(every one tandem runs)."""
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_OF_MODEL_TYPE.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


CONTEXT_SOURCE = (
    "max_position_embeddings in its config.json, times a linear or yarn rope scaling factor"
)
"""Where a model's context length comes from, as errors about it say."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (transformers 5.x `rope_parameters`, or legacy keys)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    # yarn only (transformers' defaults): the ramp between extrapolated and interpolated
    # frequencies, and the factor cos/sin are scaled by (None: from factor and mscale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ModelSpec:
    """Shape and options of a decoder-only Llama-family model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]
    checkpoint_dtype: str  # as config.json declares it ("" where it does not)
    eos_token_ids: tuple[int, ...] = field(default=())

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes: `max_position_embeddings`, or with a linear or
        yarn rope scaling the original length times its factor when that is more (as vLLM
        derives it)."""
        rope, length = self.rope, self.max_position_embeddings
        if rope.rope_type == "linear" and rope.factor > 1:
            return int(length * rope.factor)
        if rope.rope_type == "yarn" and rope.factor > 1:
            return max(length, int(rope.original_max_position_embeddings * rope.factor))
        return length

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read and validate `config.json` of a local checkpoint directory."""
    path = Path(model_dir)
    if path.is_file():
        raise CheckpointError(f"{str(path)!r} is a file: a model is a checkpoint's directory")
    if not path.is_dir():
        raise CheckpointError(
            f"model directory {str(path)!r} does not exist (tandem loads local checkpoints "
            "and models the Hugging Face cache holds; nothing is downloaded)"
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{str(path)!r} has no config.json; expected a Hugging Face checkpoint"
        )
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from None
    try:
        return spec_from_config(cfg)
    except CheckpointError as exc:
        raise CheckpointError(f"{str(path)!r}: {exc}") from None


_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "num_key_value_heads": 8,
    },
    "Qwen2ForCausalLM": {
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "num_key_value_heads": 32,
    },
    "Qwen3ForCausalLM": {
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "num_key_value_heads": 32,
        "head_dim": 128,
    },
}
"""What transformers' config class of each architecture takes for a key config.json leaves
out (transformers 5.x): a checkpoint then runs as transformers runs it."""


_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")  # fmt: skip
"""config.json keys every supported architecture needs, each a positive integer."""


def spec_from_config(cfg: Any) -> ModelSpec:
    """The model a checkpoint's config.json describes. Raises UnsupportedModelError for what
    tandem does not run, CheckpointError for a config.json that lacks a key or has a value of
    the wrong kind (never a bare KeyError or TypeError)."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"config.json holds a JSON {type(cfg).__name__}, not an object")
    try:
        arch = _architecture(cfg)
        for key in _POSITIVE:
            value = cfg.get(key)
            if key not in cfg:
                raise CheckpointError(f"config.json has no {key!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(
                    f"config.json's {key} must be a positive integer, got {value!r}"
                )
        return _spec(cfg, arch)
    except UnsupportedModelError:
        raise
    except KeyError as exc:
        raise CheckpointError(f"config.json has no {exc.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        raise CheckpointError(f"config.json has a value tandem cannot read: {exc}") from None


def _architecture(cfg: dict[str, Any]) -> str:
    """The supported architecture of a config.json: its `model_type`'s, as transformers'
    `AutoModelForCausalLM` picks it (whatever `architectures` says), else the first in
    `architectures`."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in ARCHITECTURE_OF_MODEL_TYPE:
        return ARCHITECTURE_OF_MODEL_TYPE[model_type]
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):  # (a list in every Hugging Face config; a lone name is clear)
        archs = [archs]
    if not archs:
        raise UnsupportedModelError(
            "config.json names no architecture ('architectures' or 'model_type'); supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(arch)


def _spec(cfg: dict[str, Any], arch: str) -> ModelSpec:
    if cfg.get("quantization_config"):
        quant = cfg["quantization_config"]
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedModelError(
            f"quantized checkpoints are not supported (quantization_config: {method!r}); "
            "load a float32, float16 or bfloat16 checkpoint"
        )
    cfg = {**_HF_DEFAULTS[arch], **cfg}  # (an explicit null stays null)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # (one function: transformers maps both to SiLU)
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu' is")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}"
        )
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    num_layers = int(cfg["num_hidden_layers"])
    is_qwen2 = arch == "Qwen2ForCausalLM"
    # (transformers' Mistral has no biases: it ignores the key, and its checkpoints store none)
    attention_bias = bool(cfg.get("attention_bias", False)) and arch != "MistralForCausalLM"
    return ModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_spec(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
        mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_windows=_sliding_windows(cfg, arch, num_layers),
        checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or ""),
        eos_token_ids=_as_ids(cfg.get("eos_token_id")),
    )


def _rope_spec(cfg: dict[str, Any]) -> RopeSpec:
    # (as transformers 5: a legacy `rope_scaling` replaces `rope_parameters` whole, so a
    # checkpoint re-saved by transformers 5 and given `rope_scaling` by hand runs scaled; the
    # theta is then the scaling dict's, else the top-level `rope_theta`, else 10000)
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else float(partial)
    if rope_type != "default" and partial != 1.0:  # (transformers' rotation fails on it too)
        raise UnsupportedModelError(
            f"partial_rotary_factor {partial} with rope_type {rope_type!r} is not supported "
            "(these architectures rotate the whole head)"
        )
    max_position = int(cfg.get("max_position_embeddings") or 2048)
    original = int(
        cfg.get("original_max_position_embeddings")  # (Phi-3 style: outside the rope dict)
        or params.get("original_max_position_embeddings")
        or max_position
    )
    factor = params.get("factor")
    if factor is None:  # (yarn: the ratio of the context lengths, as transformers does)
        factor = max_position / original if rope_type == "yarn" else 1.0
    return RopeSpec(
        theta=float(params["rope_theta"]),
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        # (transformers' default rope of these architectures rotates the whole head whatever
        # the factor says; with a scaled one, a factor other than 1 is refused above)
        partial_rotary_factor=1.0,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=_optional_float(params.get("attention_factor")),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _sliding_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window (None = full attention), following transformers' conventions
    (its Llama attends in full whatever `sliding_window` or `layer_types` say)."""
    if arch == "LlamaForCausalLM":
        return (None,) * num_layers
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get(
        "use_sliding_window", False
    ):
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
        return tuple(
            int(window) if t == "sliding_attention" and window else None for t in layer_types
        )
    if window is None:
        return (None,) * num_layers
    if arch == "MistralForCausalLM":
        return (int(window),) * num_layers
    first_sliding = int(cfg.get("max_window_layers", num_layers))
    return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
