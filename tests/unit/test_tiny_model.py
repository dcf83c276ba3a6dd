"""Tests of tandem.deploy.tiny_model (random HF checkpoints) and the `tandem tiny-model` CLI."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from tandem.deploy.cli import app
from tandem.deploy.tiny_model import CHAT_TEMPLATE, build_tiny_checkpoint, train_tiny_tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
TEXT = "Hello world, café naïve 中文 模型 🚀 12345!"


def _load(path: Path) -> Any:
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, output_loading_info=True
    )
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def _tensor_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_with_transformers(
    tiny_checkpoint: Callable[..., Path], arch: str
) -> None:
    path = tiny_checkpoint(arch=arch)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 64
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16
    assert config["vocab_size"] == 512
    assert config["intermediate_size"] == 128
    assert config["max_position_embeddings"] == 2048
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert config["tie_word_embeddings"] is False
    assert config["bos_token_id"] == 0 and config["eos_token_id"] == 0
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2]

    model = _load(path)
    assert (
        type(model).__name__
        == {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM",
        }[arch]
    )
    hf_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # AutoTokenizer may pick a model-specific class (Qwen2Tokenizer for qwen2): it must encode
    # exactly like the trained tokenizer.
    assert hf_tok.encode(TEXT) == train_tiny_tokenizer(512).encode(TEXT)
    ids: Any = hf_tok.apply_chat_template(
        [{"role": "user", "content": TEXT}], add_generation_prompt=True, return_dict=False
    )
    assert hf_tok.decode(ids) == f"<|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_biases_and_norms_are_random(tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    path = tiny_checkpoint(arch=arch)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert not torch.allclose(norm, torch.ones_like(norm))
        assert 0.5 < norm.mean().item() < 1.5
        if arch == "qwen2":
            for proj in ("q", "k", "v"):
                bias = f.get_tensor(f"model.layers.0.self_attn.{proj}_proj.bias")
                assert bias.abs().min().item() > 0.0
            assert "model.layers.0.self_attn.o_proj.bias" not in names
        else:
            q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
            assert q_norm.shape == (16,)
            assert not torch.allclose(q_norm, torch.ones_like(q_norm))
            assert "model.layers.0.self_attn.q_proj.bias" not in names


def test_explicit_head_dim_and_intermediate(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(arch="qwen3", head_dim=32, intermediate=96, layers=1)
    model = _load(path)
    assert model.config.head_dim == 32
    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (4 * 32, 64)
    assert tuple(attn.k_proj.weight.shape) == (2 * 32, 64)
    assert tuple(model.model.layers[0].mlp.up_proj.weight.shape) == (96, 64)


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1}
    a = build_tiny_checkpoint(tmp_path / "a", seed=3, **kwargs)
    b = build_tiny_checkpoint(tmp_path / "b", seed=3, **kwargs)
    c = build_tiny_checkpoint(tmp_path / "c", seed=4, **kwargs)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # The tokenizer does not depend on the seed.
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tied_embeddings(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(tie_embeddings=True)
    assert "lm_head.weight" not in _tensor_names(path)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    model = _load(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" in _tensor_names(tiny_checkpoint())


def test_llama3_rope_scaling_and_bfloat16(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    path = build_tiny_checkpoint(
        tmp_path, layers=1, rope_scaling=scaling, rope_theta=500000.0, dtype="bfloat16"
    )
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert rope == {**scaling, "rope_theta": 500000.0}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    model = _load(path)
    assert model.config.rope_parameters["rope_type"] == "llama3"


def test_mistral_sliding_window(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    config = json.loads((tiny_checkpoint(arch="mistral") / "config.json").read_text())
    assert config["sliding_window"] is None
    path = build_tiny_checkpoint(tmp_path, arch="mistral", layers=1, sliding_window=64)
    assert json.loads((path / "config.json").read_text())["sliding_window"] == 64
    with pytest.raises(ValueError, match="sliding_window"):
        build_tiny_checkpoint(tmp_path / "x", arch="llama", sliding_window=64)


def test_vocab_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too small"):
        build_tiny_checkpoint(tmp_path / "small", vocab=100)
    with pytest.raises(ValueError, match="arch"):
        build_tiny_checkpoint(tmp_path / "arch", arch="gpt2")
    with pytest.raises(ValueError, match="multiple of the number of attention heads"):
        build_tiny_checkpoint(tmp_path / "heads", hidden=64, heads=3, kv_heads=1, head_dim=16)
    big = train_tiny_tokenizer(4096)
    assert 512 < len(big) < 4096  # training yields fewer tokens than asked for
    assert len(train_tiny_tokenizer(300)) == 300


def test_tokenizer_config_has_chat_template(tiny_checkpoint: Callable[..., Path]) -> None:
    config = json.loads((tiny_checkpoint() / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == "<|endoftext|>"


def test_cli_writes_checkpoint(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "ckpt"
    args = ["tiny-model", str(out), "--arch", "qwen2", "--layers", "1", "--hidden", "32"]
    result = runner.invoke(app, [*args, "--heads", "2", "--kv-heads", "1", "--seed", "7"])
    assert result.exit_code == 0, result.output
    assert "wrote tiny qwen2 checkpoint" in result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == (
        "qwen2",
        32,
        1,
    )
    again = runner.invoke(app, args)
    assert again.exit_code != 0
    assert "--force" in again.output
    forced = runner.invoke(app, [*args, "--heads", "2", "--kv-heads", "1", "--force"])
    assert forced.exit_code == 0, forced.output
    bad = runner.invoke(app, ["tiny-model", str(tmp_path / "bad"), "--heads", "3"])
    assert bad.exit_code == 2
    assert "kv_heads" in bad.output
    (tmp_path / "a_file").write_text("x")  # a directory cannot be made under a file
    unwritable = runner.invoke(app, ["tiny-model", str(tmp_path / "a_file" / "sub")])
    assert unwritable.exit_code == 2 and "Traceback" not in unwritable.output
    assert "Error:" in unwritable.output
    no_rope = runner.invoke(app, ["tiny-model", str(tmp_path / "r"), "--rope-theta", "0"])
    assert no_rope.exit_code == 2 and "rope-theta" in no_rope.output


def test_generate_checks_its_options_in_one_line(tmp_path: Path) -> None:
    """Bad numbers are refused before the model loads, in one line (no traceback)."""
    runner = CliRunner()
    missing = str(tmp_path / "none")
    threads = runner.invoke(app, ["generate", "--model", missing, "--threads", "-2"])
    assert threads.exit_code == 2 and "--threads" in threads.output
    top_p = runner.invoke(app, ["generate", "--model", missing, "--top-p", "5"])
    assert top_p.exit_code == 2 and "top_p" in top_p.output
    assert "Traceback" not in top_p.output and len(top_p.output.strip().splitlines()) == 1


def test_cli_help() -> None:
    runner = CliRunner()
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0 and "tiny-model" in top.output
    sub = runner.invoke(app, ["tiny-model", "--help"])
    assert sub.exit_code == 0
    for option in ("--arch", "--kv-heads", "--tie-embeddings", "--init-std", "--force"):
        assert option in sub.output


def test_generate_reads_prompts_from_a_file(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """`--prompts-file`: one prompt per non-blank line, after any `--prompt`; the tokens are
    those of `LLM.generate` on the same prompts. A missing or empty file is one line."""
    from tandem import LLM, SamplingParams

    model = str(tiny_checkpoint())
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("first line\n\n  \nsecond, café 🚀\n", encoding="utf-8")
    runner = CliRunner()
    common = ["generate", "--model", model, "--max-tokens", "4", "--ignore-eos", "--json"]
    result = runner.invoke(app, [*common, "-p", "given", "--prompts-file", str(prompts_file)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == ["given", "first line", "second, café 🚀"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = LLM(model=model).generate([r["prompt"] for r in rows], params)
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in expected]
    missing = runner.invoke(app, [*common, "--prompts-file", str(tmp_path / "none.txt")])
    assert missing.exit_code == 2 and "cannot read --prompts-file" in missing.output
    assert "Traceback" not in missing.output
    (tmp_path / "blank.txt").write_text("\n \n")
    blank = runner.invoke(app, [*common, "--prompts-file", str(tmp_path / "blank.txt")])
    assert blank.exit_code == 2 and "has no prompt" in blank.output


def test_generate_chat_renders_the_template_or_says_there_is_none(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from tandem import LLM, SamplingParams

    model = tiny_checkpoint()
    runner = CliRunner()
    common = ["--max-tokens", "3", "--ignore-eos", "--json", "--chat", "-p", "hi there"]
    result = runner.invoke(app, ["generate", "--model", str(model), *common])
    assert result.exit_code == 0, result.output
    row = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = LLM(model=str(model)).chat([{"role": "user", "content": "hi there"}], params)[0]
    assert row["token_ids"] == want.token_ids
    bare = tmp_path / "no-template"
    shutil.copytree(model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    refused = runner.invoke(app, ["generate", "--model", str(bare), *common])
    assert refused.exit_code == 2 and "has no chat template" in refused.output
    assert "drop --chat" in refused.output and "Traceback" not in refused.output
