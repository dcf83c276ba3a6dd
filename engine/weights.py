"""Loading Hugging Face checkpoints (safetensors, single file or sharded; else PyTorch `.bin`
files, `torch_bin.py`) into `CausalLM`.

HF names map onto ours one to one, except that q/k/v projections are fused into `qkv_proj` and
gate/up into `gate_up_proj` (one matmul each instead of three and two).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tandem.engine.errors import CheckpointError, UnsupportedModelError
from tandem.engine.model import CausalLM
from tandem.engine.model_config import ModelSpec
from tandem.engine.torch_bin import TorchBinFile

logger = logging.getLogger(__name__)

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: `model.safetensors`, else the shards its index lists
    (transformers' order: an index left behind by an earlier sharded save is ignored), else
    any safetensors; with none, its PyTorch `.bin` files the same way (as transformers and
    vLLM fall back to them)."""
    for files in (
        _listed_files(model_dir, "model.safetensors", "*.safetensors"),
        # (not `*.bin`: a trainer's training_args.bin or optimizer.bin is no weights file)
        _listed_files(model_dir, "pytorch_model.bin", "pytorch_model*.bin"),
    ):
        if files:
            return files
    others = sorted(f.name for f in model_dir.glob("*.bin"))
    raise CheckpointError(
        f"{model_dir} has no model.safetensors, safetensors shards or pytorch_model*.bin "
        "weights" + (f" (its {', '.join(others)} are not a model's weights)" if others else "")
    )


def _listed_files(model_dir: Path, single_name: str, others: str) -> list[Path]:
    """The files of one format: `single_name`, else the shards of `single_name.index.json`,
    else those matching `others` ([] where there is none)."""
    single = model_dir / single_name
    if single.is_file():
        return [single]
    index = model_dir / f"{single_name}.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{index} is not valid JSON: {exc}") from None
        except AttributeError:  # (not an object)
            weight_map = None
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise CheckpointError(
                f"{index} has no weight_map (an object naming each tensor's shard file)"
            )
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{model_dir}: shards listed in {index.name} are missing: {missing}"
            )
        return files
    return sorted(model_dir.glob(others))


def stored_dtype(model_dir: Path) -> str:
    """The dtype of a checkpoint's first floating-point weight, read from the safetensors
    header ("" when there is none to read)."""
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    for file in checkpoint_files(model_dir):
        with _opened(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                stored = handle.get_slice(name).get_dtype()
                if stored.startswith(("F", "BF")):
                    return names.get(stored, stored)
    return ""


@contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """`safe_open(file)` (a `.bin` file: `TorchBinFile`); a file that cannot be read (cut short
    by an interrupted download, or not weights at all) is a CheckpointError naming it."""
    if file.suffix == ".bin":
        yield TorchBinFile(file)
        return
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except SafetensorError as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


TensorSource = Callable[[list[Path]], Iterator[tuple[str, torch.Tensor]]]
"""What `load_weights` reads a checkpoint's (name, tensor) pairs with."""


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with _opened(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


def iter_checkpoint_shapes(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `iter_checkpoint_tensors`, but meta tensors of the stored shapes: from safetensors
    headers alone (no weight is read); a `.bin` file is unpickled, memory-mapped (`torch_bin`)."""
    for file in files:
        with _opened(file) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, torch.empty(handle.get_slice(name).get_shape(), device="meta")


def check_weights(spec: ModelSpec, model_dir: Path) -> None:
    """Raises what `load_weights` would (a tensor missing, unknown or of the wrong shape, an
    unreadable file) from the stored shapes and a model on the meta device: cheap for any
    model size (from safetensors headers; `.bin` files are mapped, not read), for a process
    that checks a checkpoint without loading it (`tandem serve`, before its workers start)."""
    with torch.device("meta"):
        model = CausalLM(spec, attention_backend="reference")
    load_weights(model, model_dir, torch.float32, read=iter_checkpoint_shapes)


def load_weights(
    model: CausalLM,
    model_dir: Path,
    dtype: torch.dtype,
    *,
    read: TensorSource = iter_checkpoint_tensors,
) -> None:
    """Copies every checkpoint tensor into `model`, fusing projections; strict about names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # target -> part -> stored
    tied: dict[str, torch.Tensor] = {}  # (with tied embeddings: those of `_TIED` stored)
    prefix = ""  # (the checkpoint's names: "model.layers.0..." as transformers saves them)
    for hf_name, tensor in read(checkpoint_files(model_dir)):
        name = hf_name.removeprefix("model.")
        prefix = "model." if name != hf_name else prefix
        if name.startswith("rotary_emb.") or name.endswith("rotary_emb.inv_freq"):
            continue
        if name in _TIED and model.spec.tie_word_embeddings:
            tied[name] = tensor
            continue
        fused = _fused_target(name)
        if fused is None:
            _copy(params, name, tensor, dtype, stored_name=hf_name)
            loaded.add(name)
            continue
        target, part = fused
        parts = pending.setdefault(target, {})
        parts[part] = (hf_name, tensor)
        if len(parts) == len(_FUSED[_fused_kind(target)]):
            stored = [parts[p] for p in _FUSED[_fused_kind(target)]]
            _check_fusable(params.get(target), stored)
            fused_tensor = torch.cat([t for _, t in stored], dim=0)
            _copy(params, target, fused_tensor, dtype, stored_name=stored[0][0])
            loaded.add(target)
            del pending[target]
    if pending:  # (the parts not there, as the checkpoint would name them)
        absent = [
            stored
            for target, parts in sorted(pending.items())
            for stored in _stored_names(target, prefix)
            if stored not in {hf_name for hf_name, _ in parts.values()}
        ]
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {absent[:8]}")
    if model.spec.tie_word_embeddings:
        for name, tensor in _tied_weights(tied, model_dir).items():
            _copy(params, name, tensor, dtype)
            loaded.add(name)
    missing = [
        stored for name in sorted(set(params) - loaded) for stored in _stored_names(name, prefix)
    ]
    if missing:
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {missing[:8]}")
    if not model.lm_head.weight.is_meta:  # (`check_weights` loads nothing)
        logger.info("loaded %d tensors from %s", len(loaded), model_dir)


_TIED = ("embed_tokens.weight", "lm_head.weight")


def _tied_weights(stored: dict[str, torch.Tensor], model_dir: Path) -> dict[str, torch.Tensor]:
    """The input embedding and output head of a model with tied embeddings, from what the
    checkpoint stores of them, as transformers 5 ties them: one stored serves as both; both
    stored and different are each used as stored (with a warning)."""
    embed, head = (stored.get(name) for name in _TIED)
    if (
        embed is not None
        and head is not None
        and not embed.is_meta  # (`check_weights`: shapes only, no values to compare)
        and not torch.equal(embed, head)
    ):
        logger.warning(
            "%s: tie_word_embeddings is set, but lm_head.weight differs from "
            "embed_tokens.weight: each is used as stored (as transformers does)",
            model_dir,
        )
        return {_TIED[0]: embed, _TIED[1]: head}
    one = embed if embed is not None else head
    if one is None:
        raise CheckpointError(
            f"{model_dir}: weights missing from the checkpoint: {list(_TIED)} (one of them is "
            "needed with tie_word_embeddings)"
        )
    return {name: one for name in _TIED}


def _stored_names(name: str, prefix: str) -> list[str]:
    """The checkpoint names of one of the model's parameters: a fused projection's parts,
    under the checkpoint's `prefix` ("model." as transformers saves them) but for the head."""
    pieces = name.split(".")
    modules = _FUSED.get(pieces[-2], (pieces[-2],)) if len(pieces) >= 2 else (None,)
    names = [name if m is None else ".".join([*pieces[:-2], m, pieces[-1]]) for m in modules]
    return [n if n.startswith("lm_head.") else f"{prefix}{n}" for n in names]


def _fused_kind(target: str) -> str:
    return target.rsplit(".", 2)[-2]


def _fused_target(name: str) -> tuple[str, str] | None:
    """'layers.0.self_attn.k_proj.bias' -> ('layers.0.self_attn.qkv_proj.bias', 'k_proj')."""
    pieces = name.split(".")
    if len(pieces) < 2:
        return None
    module, leaf = pieces[-2], pieces[-1]
    for fused, members in _FUSED.items():
        if module in members:
            return ".".join([*pieces[:-2], fused, leaf]), module
    return None


def _check_fusable(
    param: torch.nn.Parameter | None, stored: list[tuple[str, torch.Tensor]]
) -> None:
    """CheckpointError naming the stored tensors when they cannot be stacked into `param`
    (q, k, v or gate, up projections whose other dimensions or rows do not fit the config)."""
    if param is None:
        return  # (`_copy` names the missing counterpart)
    rows = sum(t.shape[0] if t.dim() else 0 for _, t in stored)
    if rows == param.shape[0] and all(t.shape[1:] == param.shape[1:] for _, t in stored):
        return
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in stored)
    raise CheckpointError(
        f"shape mismatch: {shapes}; the config expects {tuple(param.shape)} for them together "
        "(their rows stacked)"
    )


def _copy(
    params: dict[str, torch.nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    *,
    stored_name: str | None = None,
) -> None:
    """Copies `tensor` into parameter `name`; errors name it as the checkpoint does
    (`stored_name`)."""
    param, shown = params.get(name), stored_name or name
    if param is None:
        raise UnsupportedModelError(
            f"checkpoint tensor {shown!r} has no counterpart in tandem's model "
            "(a feature of this checkpoint is not supported)"
        )
    if tuple(param.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"shape mismatch for {shown!r}: checkpoint {tuple(tensor.shape)}, config expects "
            f"{tuple(param.shape)}"
        )
    with torch.no_grad():
        param.data = tensor.to(dtype).contiguous()
