"""Checkpoints that leave keys out or store their weights unusually load as transformers loads
them: its config classes' defaults, its tying of embeddings, its choice of weight files, its
end-of-sequence ids; and a tokenizer larger than the model cannot crash a batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError, UnsupportedModelError
from tandem.engine.model_config import load_model_spec, spec_from_config
from tests.hf_reference import hf_greedy, load_hf_model, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300}
KV = {"num_key_value_heads": 2}


def _spec(arch: str, **cfg: Any) -> Any:
    kv = {} if arch == "LlamaForCausalLM" else KV  # (the others' class default is 8 or 32)
    return spec_from_config({"architectures": [arch], "num_hidden_layers": 30, **BASE, **kv, **cfg})


def test_keys_left_out_take_transformers_class_defaults() -> None:
    assert _spec("Qwen2ForCausalLM").max_position_embeddings == 32768
    assert _spec("MistralForCausalLM").max_position_embeddings == 131072
    assert _spec("LlamaForCausalLM").max_position_embeddings == 2048
    yarn = {"rope_type": "yarn", "factor": 4.0}  # (original length: the model's default)
    assert (
        _spec("LlamaForCausalLM", rope_scaling=yarn).rope.original_max_position_embeddings == 2048
    )
    assert _spec("MistralForCausalLM").sliding_windows == (4096,) * 30
    assert _spec("MistralForCausalLM", sliding_window=None).sliding_windows == (None,) * 30
    windows = _spec("Qwen2ForCausalLM", use_sliding_window=True).sliding_windows
    assert windows == (None,) * 28 + (4096, 4096)  # (max_window_layers: 28)
    # (transformers' Llama attends in full: a window in its config.json changes nothing)
    layers = ["sliding_attention", "full_attention"] * 15
    llama = _spec("LlamaForCausalLM", sliding_window=8, layer_types=layers)
    assert llama.sliding_windows == (None,) * 30
    assert _spec("Qwen3ForCausalLM").head_dim == 128
    assert _spec("Qwen3ForCausalLM", head_dim=16).head_dim == 16
    assert _spec("LlamaForCausalLM").num_kv_heads == 4


def test_bias_keys_that_transformers_ignores_for_an_architecture_are_ignored() -> None:
    """transformers' Mistral has no biases and its Qwen2 no o_proj or MLP bias, whatever
    config.json says: a checkpoint of theirs that says otherwise stores none, and loads."""
    mistral = _spec("MistralForCausalLM", attention_bias=True, mlp_bias=True)
    assert (mistral.qkv_bias, mistral.o_bias, mistral.mlp_bias) == (False, False, False)
    qwen2 = _spec("Qwen2ForCausalLM", attention_bias=True, mlp_bias=True)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias) == (True, False, False)
    llama = _spec("LlamaForCausalLM", attention_bias=True, mlp_bias=True)
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)


def test_quantized_checkpoints_are_refused_by_name() -> None:
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(UnsupportedModelError, match="quantized checkpoints.*'fp8'"):
        _spec("LlamaForCausalLM", quantization_config=quant)


def _copy_checkpoint(src: Path, dst: Path, **config: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in config.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _assert_equals_hf(path: Path, prompts: list[list[int]]) -> None:
    want = hf_greedy(load_hf_model(path), prompts, GREEDY.max_tokens or 0)
    llm = LLM(model=str(path), num_kv_blocks=128)
    got = [
        out.token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    ]
    assert got == want


def test_yarn_without_max_position_embeddings_equals_transformers(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    src = tiny_checkpoint(arch="llama", seed=11)
    cfg = json.loads((src / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    rope_key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    path = _copy_checkpoint(
        src, tmp_path / "ckpt", max_position_embeddings=None, **{rope_key: yarn}
    )
    assert load_model_spec(path).rope.original_max_position_embeddings == 2048
    _assert_equals_hf(path, random_prompts(3, 256, seed=3))


@pytest.mark.parametrize(
    "config",
    [
        {  # (a transformers-5 config given `rope_scaling` by hand: the scaling dict wins whole)
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        {  # (transformers' default rope of these models rotates the whole head)
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            "rope_scaling": None,
        },
        {"architectures": ["MistralForCausalLM"]},  # (`AutoModelForCausalLM` goes by model_type)
        {"architectures": None, "hidden_act": "swish"},  # (model_type alone; SiLU's other name)
    ],
    ids=["rope-scaling-over-rope-parameters", "partial-rotary-default", "model-type", "swish"],
)
def test_config_keys_read_as_transformers_reads_them(
    tiny_checkpoint: Any, tmp_path: Path, config: dict[str, Any]
) -> None:
    src = tiny_checkpoint(arch="llama", seed=12)
    assert json.loads((src / "config.json").read_text())["model_type"] == "llama"
    path = _copy_checkpoint(src, tmp_path / "ckpt", **config)
    assert load_model_spec(path).architecture == "LlamaForCausalLM"
    _assert_equals_hf(path, random_prompts(3, 256, seed=4, max_len=70))


def _untied_head(path: Path, scale: float) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone() * scale
    save_file(tensors, file, metadata={"format": "pt"})


def test_tied_checkpoints_storing_a_different_head_or_only_the_head_equal_transformers(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    src = tiny_checkpoint(arch="qwen2", seed=12, tie_embeddings=True)
    prompts = random_prompts(3, 256, seed=4)
    both = _copy_checkpoint(src, tmp_path / "both")
    _untied_head(both, -0.5)  # (stored too, and different: used as stored)
    _assert_equals_hf(both, prompts)
    head_only = _copy_checkpoint(src, tmp_path / "head-only")
    tensors = load_file(head_only / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, head_only / "model.safetensors", metadata={"format": "pt"})
    _assert_equals_hf(head_only, prompts)


def test_a_stale_shard_index_beside_model_safetensors_is_ignored(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    path = _copy_checkpoint(tiny_checkpoint(arch="llama", seed=1), tmp_path / "ckpt")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_equals_hf(path, random_prompts(2, 256, seed=5))


def test_generation_config_eos_replaces_config_json_eos(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    path = _copy_checkpoint(tiny_checkpoint(arch="llama", seed=1), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [7, 9]}))
    llm = LLM(model=str(path), num_kv_blocks=64)
    tokenizer_eos = llm.get_tokenizer().eos_token_id
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [11]}))
    llm = LLM(model=str(path), num_kv_blocks=64)
    assert llm.engine.eos_token_ids == {11, tokenizer_eos}


def test_a_text_prompt_with_ids_beyond_the_model_is_refused_and_the_batch_goes_on(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    path = _copy_checkpoint(tiny_checkpoint(arch="llama", seed=1), tmp_path / "ckpt")
    vocab = 100  # the model keeps the first 100 of the tokenizer's ids
    tensors = load_file(path / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name][:vocab].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    engine = LLM(model=str(path), num_kv_blocks=64).engine
    text = engine.tokenizer.decode([250, 251])
    assert max(engine.tokenizer.encode(text)) >= vocab
    ok = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request(text, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert ok.finish_reason == "length" and len(ok.output_token_ids) == GREEDY.max_tokens
    engine.check_integrity()


def test_chat_without_a_template_says_how_to_give_one(tiny_checkpoint: Any, tmp_path: Path) -> None:
    path = _copy_checkpoint(tiny_checkpoint(arch="llama", seed=1), tmp_path / "ckpt")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), num_kv_blocks=64)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="no chat template: pass one as chat_template="):
        llm.chat(messages, GREEDY)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(messages, GREEDY, chat_template=template)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("hi")


def test_the_router_refuses_a_text_prompt_beyond_the_vocabulary(tiny_checkpoint: Any) -> None:
    from tandem.engine.tokenizer import Tokenizer
    from tandem.router.errors import APIError
    from tandem.router.request_prep import tokenize_prompt

    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint(arch="llama", seed=1))
    text = tokenizer.decode([250, 251])
    assert tokenize_prompt(tokenizer, text, 512) == tokenizer.encode(text)
    with pytest.raises(APIError) as err:
        tokenize_prompt(tokenizer, text, 100)
    assert err.value.status == 400 and err.value.param == "prompt"


def test_auto_dtype_without_a_declared_dtype_reads_the_stored_weights(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    from tandem.engine.config import checkpoint_dtype

    path = _copy_checkpoint(tiny_checkpoint(arch="llama", seed=1), tmp_path / "ckpt")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_dtype(str(path)) == "bfloat16"
    cfg["dtype"] = "float16"  # (a declared dtype wins, as in transformers)
    (path / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_dtype(str(path)) == "float16"
