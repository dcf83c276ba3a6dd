"""A checkpoint that holds PyTorch `.bin` weights instead of safetensors (older Hugging Face
saves) loads as transformers and vLLM load it: one `pytorch_model.bin`, or shards named by
`pytorch_model.bin.index.json`; a trainer's `training_args.bin` beside them is no weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tandem import LLM, SamplingParams
from tandem.engine.checkpoint import model_revision
from tandem.engine.errors import CheckpointError
from tandem.engine.weights import checkpoint_files

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def as_bin(source: Path, target: Path, shards: int) -> Path:
    """`source`'s checkpoint with its weights in `shards` .bin files (and an index if more)."""
    shutil.copytree(source, target)
    state = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    names = sorted(state)
    if shards == 1:
        torch.save(state, target / "pytorch_model.bin")
    else:
        weight_map = {}
        for i in range(shards):
            file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            part = {n: state[n] for n in names[i::shards]}
            torch.save(part, target / file)
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (target / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    torch.save({"not": "weights"}, target / "training_args.bin")
    return target


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_weights_give_the_safetensors_outputs(
    tiny_checkpoint: Any, tmp_path: Path, shards: int
) -> None:
    source = tiny_checkpoint()
    target = as_bin(source, tmp_path / "bin", shards)
    assert all(f.name.startswith("pytorch_model") for f in checkpoint_files(target))
    assert len(checkpoint_files(target)) == shards
    prompts = ["hello there", "the bin file"]
    want = LLM(model=str(source), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(model=str(target), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert model_revision(target) != model_revision(source)


def test_a_broken_bin_file_is_named(tiny_checkpoint: Any, tmp_path: Path) -> None:
    target = as_bin(tiny_checkpoint(), tmp_path / "bin", 1)
    (target / "pytorch_model.bin").write_bytes(b"cut short")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: not a readable PyTorch"):
        LLM(model=str(target), num_kv_blocks=64)
