"""Bad input gets a specific exception with a clear message, and the engine keeps working."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.errors import (
    CheckpointError,
    InvalidRequestError,
    PromptTooLongError,
    UnsupportedModelError,
)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(model=str(tiny_checkpoint()), num_kv_blocks=64, max_model_len=128)


def _still_works(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    llm.engine.check_integrity()
    assert not llm.engine.requests
    assert llm.engine.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(llm: LLM, prompt: Any) -> None:
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([prompt])
    _still_works(llm)


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError, match="max_model_len is 128"):
        llm.generate([[1] * 128])
    _still_works(llm)


def test_bad_prompt_in_a_batch_leaves_nothing_queued(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2], [3, 10_000]])
    _still_works(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be 0 or -1"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must be <= max_tokens \(4\)"),
        # (-1 indexed the vocabulary from its end: min_tokens kept its last token out)
        ({"stop_token_ids": [5, -1]}, r"stop_token_ids must be token ids \(>= 0\)"),
        ({"allowed_token_ids": [-3]}, r"allowed_token_ids must be token ids \(>= 0\)"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_min_tokens_over_max_tokens_names_min_tokens() -> None:
    """The error's `param` (an HTTP 400's) is the field at fault; it was None."""
    with pytest.raises(InvalidRequestError) as bad:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert bad.value.param == "min_tokens"
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_seeds_at_the_ends_of_the_64_bit_range_sample(llm: LLM) -> None:
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True)
        first, again = llm.generate([[1, 2, 3], [1, 2, 3]], [params, params])
        assert len(first.token_ids) == 3 and first.token_ids == again.token_ids
    _still_works(llm)


def test_params_count_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1]], [SamplingParams(), SamplingParams()])


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_checkpoint: Any, tmp_path: Path) -> None:
    path = _copy_checkpoint(tiny_checkpoint(), tmp_path / "gpt2")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(model=str(path))


def test_unsupported_rope_type(tiny_checkpoint: Any, tmp_path: Path) -> None:
    path = _copy_checkpoint(tiny_checkpoint(), tmp_path / "longrope")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="rope_type 'longrope'.*yarn, dynamic"):
        LLM(model=str(path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"num_attention_heads": None}, "num_attention_heads must be a positive integer"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
        ({"rope_scaling": [1]}, "a value tandem cannot read"),
        ({"eos_token_id": "x"}, "a value tandem cannot read"),
    ],
)
def test_a_config_with_a_bad_value_is_named(
    tiny_checkpoint: Any, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    """It raised a bare ZeroDivisionError, KeyError or TypeError from deep in the loading."""
    path = _copy_checkpoint(tiny_checkpoint(), tmp_path / "bad")
    cfg = json.loads((path / "config.json").read_text())
    if "rope_scaling" in change:  # (read only without the newer key)
        cfg.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=f"bad': config.json.*{message}"):
        LLM(model=str(path))
    del cfg["num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json has no 'num_hidden_layers'"):
        LLM(model=str(path))
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not an object"):
        LLM(model=str(path))


def test_missing_weights(tiny_checkpoint: Any, tmp_path: Path) -> None:
    path = _copy_checkpoint(tiny_checkpoint(), tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        LLM(model=str(path))


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(model=str(tmp_path))


def test_incomplete_weights_are_named(tiny_checkpoint: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(tiny_checkpoint(), tmp_path / "partial")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="norm.weight"):
        LLM(model=str(path))


def test_max_model_len_beyond_the_models_context(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """As vLLM: no longer than `max_position_embeddings` (times a linear or yarn factor)."""
    path = tiny_checkpoint()  # max_position_embeddings 2048
    with pytest.raises(InvalidRequestError, match="exceeds the model's context of 2048 tokens"):
        LLM(model=str(path), num_kv_blocks=512, max_model_len=4096)
    assert LLM(model=str(path), num_kv_blocks=128, max_model_len=2048).engine.max_model_len == 2048
    scaled = tmp_path / "linear"
    shutil.copytree(path, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    config.pop("rope_parameters", None)
    (scaled / "config.json").write_text(json.dumps(config))
    long = LLM(model=str(scaled), num_kv_blocks=300, max_model_len=4096)
    assert long.engine.max_model_len == 4096
    # (no max_model_len: the whole scaled context, as vLLM derives it; it was 2048)
    assert LLM(model=str(scaled), num_kv_blocks=300).engine.max_model_len == 4096


def test_max_model_len_larger_than_pool(tiny_checkpoint: Any) -> None:
    with pytest.raises(InvalidRequestError, match="does not fit in the KV pool"):
        LLM(model=str(tiny_checkpoint()), num_kv_blocks=4, max_model_len=1024)


def test_sharded_checkpoint_loads(tiny_checkpoint: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint()
    path = _copy_checkpoint(src, tmp_path / "sharded")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, chunk in (
        ("model-00001-of-00002.safetensors", names[:half]),
        ("model-00002-of-00002.safetensors", names[half:]),
    ):
        save_file({n: tensors[n] for n in chunk}, str(path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, shard))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a = LLM(model=str(src), num_kv_blocks=32).generate([[1, 2, 3]], params)[0].token_ids
    b = LLM(model=str(path), num_kv_blocks=32).generate([[1, 2, 3]], params)[0].token_ids
    assert a == b
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        LLM(model=str(path))


def test_unreadable_weight_files_are_named(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """A garbage, truncated or cut-short safetensors file (an interrupted download) is a
    CheckpointError naming the file, not safetensors' own exception."""
    src = tiny_checkpoint()
    data = (src / "model.safetensors").read_bytes()
    for name, content in {"garbage": b"not safetensors" * 4, "truncated": data[: len(data) // 2],
                          "tiny": b"abc"}.items():  # fmt: skip
        path = _copy_checkpoint(src, tmp_path / name)
        (path / "model.safetensors").write_bytes(content)
        with pytest.raises(
            CheckpointError, match=r"model\.safetensors.*not a readable safetensors"
        ):
            LLM(model=str(path), num_kv_blocks=16)
    index = _copy_checkpoint(src, tmp_path / "index")
    (index / "model.safetensors").unlink()
    (index / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        LLM(model=str(index), num_kv_blocks=16)


def test_checkpoints_every_worker_would_refuse_are_refused_before_serving(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """Weights that do not fit the config, an unreadable weight file, no tokenizer: `tandem
    serve` refuses them in one line before Ray starts (each worker failed at start-up, and the
    deploy ended in pages of Ray tracebacks)."""
    from safetensors.torch import load_file, save_file

    from tandem.deploy.app_builder import resolve_model
    from tandem.deploy.cluster_config import ClusterConfig

    src = tiny_checkpoint()
    assert resolve_model(ClusterConfig(model=str(src))) == str(src.resolve())
    shape = _copy_checkpoint(src, tmp_path / "shape")
    cfg = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match="shape mismatch for 'model.layers.0.mlp"):
        resolve_model(ClusterConfig(model=str(shape)))
    partial = _copy_checkpoint(src, tmp_path / "partial")
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match="missing from the checkpoint: \\['model.norm.weight'\\]"
    ):
        resolve_model(ClusterConfig(model=str(partial)))
    # (a projection tandem stacks with others is named as the checkpoint names it, too)
    del (
        tensors["model.layers.1.mlp.up_proj.weight"],
        tensors["model.layers.0.self_attn.q_proj.weight"],
    )
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as fused:
        resolve_model(ClusterConfig(model=str(partial)))
    assert str(fused.value).endswith(
        "weights missing from the checkpoint: ['model.layers.0.self_attn.q_proj.weight', "
        "'model.layers.1.mlp.up_proj.weight']"
    )
    garbage = _copy_checkpoint(src, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"not safetensors" * 4)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        resolve_model(ClusterConfig(model=str(garbage)))
    no_tokenizer = _copy_checkpoint(src, tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer in .*expected one of tokenizer.json"):
        resolve_model(ClusterConfig(model=str(no_tokenizer)))
    broken = _copy_checkpoint(src, tmp_path / "broken-tokenizer")  # (found, but unreadable)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(CheckpointError, match="cannot load the tokenizer in"):
        resolve_model(ClusterConfig(model=str(broken)))
    with pytest.raises(ValueError, match="is a file: --model takes a checkpoint's directory"):
        resolve_model(ClusterConfig(model=str(src / "config.json")))


def test_an_unknown_dtype_lists_every_spelling(tiny_checkpoint: Any) -> None:
    """It said "Input should be 'float32', 'bfloat16' or 'float16'", leaving out the default
    ("auto") and vLLM's spellings that are taken; and "params: " before a whole-model check."""
    from pydantic import ValidationError

    from tandem.engine.config import EngineConfig
    from tandem.engine.errors import summarize_validation

    with pytest.raises(ValidationError) as refused:
        EngineConfig(model=str(tiny_checkpoint()), dtype="float8")
    assert summarize_validation(refused.value) == (
        "dtype 'float8' is not one of auto, float32, bfloat16, float16, float, half, bf16, fp16"
    )
    assert EngineConfig(model=str(tiny_checkpoint()), dtype="half").dtype == "float16"
