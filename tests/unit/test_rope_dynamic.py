"""Dynamic NTK rope scaling (`rope_type: dynamic`, or the legacy `{"type": "dynamic"}`): within
`max_position_embeddings`, the context tandem runs it to, transformers computes the default
frequencies, so greedy tokens equal transformers' (the type was refused)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tests.hf_reference import hf_greedy, load_hf_model, random_prompts


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_dynamic_rope_greedy_tokens_equal_transformers(tiny_checkpoint: Any, key: str) -> None:
    path = tiny_checkpoint(arch="llama", seed=7, rope_scaling={key: "dynamic", "factor": 2.0})
    hf = load_hf_model(path)
    prompts = random_prompts(4, hf.config.vocab_size, seed=3, min_len=30, max_len=150)
    expected = hf_greedy(hf, prompts, 12)
    llm = LLM(model=str(path), num_kv_blocks=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.llm_engine.model_config.max_model_len <= hf.config.max_position_embeddings
