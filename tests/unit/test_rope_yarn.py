"""YaRN rope scaling (Qwen3's long-context setting, and others'): frequencies and the cos/sin
factor exactly as transformers computes them, and greedy tokens equal to transformers'."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.model_config import spec_from_config
from tandem.engine.rotary import attention_scaling, inverse_frequencies
from tests.hf_reference import hf_greedy, load_hf_model, random_prompts

YARN_CASES = [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
    {"factor": 8.0, "original_max_position_embeddings": 32, "truncate": False},
    {
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
    },
    {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.5},
]


def config(rope: dict[str, Any], partial: float = 1.0) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            **rope,
        },
    }


@pytest.mark.parametrize("rope", YARN_CASES)
def test_yarn_frequencies_and_factor_are_transformers(rope: dict[str, Any]) -> None:
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = config(rope)
    hf = Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    spec = spec_from_config(cfg)
    assert torch.equal(inverse_frequencies(spec.rope, spec.head_dim), inv_freq)
    assert attention_scaling(spec.rope) == factor


def test_a_scaled_rope_over_part_of_the_head_is_refused() -> None:
    """transformers' Llama / Qwen / Mistral rotate the whole head: with a partial factor its
    own forward fails on a scaled rope (tandem ran a partial rotation no reference runs)."""
    from tandem.engine.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5 with rope_type"):
        spec_from_config(config(YARN_CASES[0], 0.5))
    top_level = {**config(YARN_CASES[0]), "partial_rotary_factor": 0.25}  # (moved in, by HF)
    del top_level["rope_parameters"]["partial_rotary_factor"]
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.25"):
        spec_from_config(top_level)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_yarn_greedy_tokens_equal_transformers(tiny_checkpoint: Any, arch: str) -> None:
    path = tiny_checkpoint(
        arch=arch,
        seed=5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    hf = load_hf_model(path)
    prompts = random_prompts(6, hf.config.vocab_size, seed=11, min_len=40, max_len=200)
    expected = hf_greedy(hf, prompts, 16)
    llm = LLM(model=str(path), num_kv_blocks=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
