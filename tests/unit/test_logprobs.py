"""`SamplingParams.logprobs`: each generated token's log-probability and the most likely
alternatives, of the model's own distribution (transformers' logits, log-softmaxed), whatever
temperature or `min_tokens` did to the sampling."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError
from tandem.engine.logprobs import token_logprobs
from tests.hf_reference import hf_last_logits, load_hf_model, random_prompts


@pytest.fixture(scope="module")
def setup(tiny_checkpoint: Any) -> dict[str, Any]:
    path = tiny_checkpoint(arch="qwen2", seed=2, kv_heads=1)
    hf = load_hf_model(path)
    return {"path": path, "hf": hf, "llm": LLM(model=str(path), num_kv_blocks=256)}


def _reference(hf: Any, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """transformers' log-softmax before each generated token."""
    return [
        torch.log_softmax(hf_last_logits(hf, prompt + tokens[:t]), dim=-1)
        for t in range(len(tokens))
    ]


def test_greedy_logprobs_and_top_alternatives_equal_transformers(setup: dict[str, Any]) -> None:
    prompts = random_prompts(4, 512, seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = setup["llm"].generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
        for token, (lp, top), ref in zip(
            out.token_ids, out.logprobs, _reference(setup["hf"], prompt, out.token_ids), strict=True
        ):
            ref_top = ref.topk(3)
            assert [t for t, _ in top] == ref_top.indices.tolist()
            assert top[0][0] == token  # greedy: the most likely one
            assert lp == pytest.approx(float(ref[token]), abs=1e-4)
            assert [v for _, v in top] == pytest.approx(ref_top.values.tolist(), abs=1e-4)


def test_sampled_tokens_get_the_model_s_logprobs_not_the_tempered_ones(
    setup: dict[str, Any],
) -> None:
    prompt = random_prompts(1, 512, seed=9)[0]
    params = SamplingParams(
        temperature=1.7, top_k=40, seed=3, max_tokens=5, min_tokens=5, logprobs=0
    )
    out = setup["llm"].generate([prompt], params, use_tqdm=False)[0]
    assert out.logprobs is not None
    refs = _reference(setup["hf"], prompt, out.token_ids)
    for token, (lp, top), ref in zip(out.token_ids, out.logprobs, refs, strict=True):
        assert top == []
        assert lp == pytest.approx(float(ref[token]), abs=1e-4)


def test_without_logprobs_there_are_none(setup: dict[str, Any]) -> None:
    out = setup["llm"].generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.logprobs is None


def test_logprobs_are_counts() -> None:
    """(their bound is the engine's: `LLM(max_logprobs=)`, the API's 20)"""
    assert SamplingParams(logprobs=21).logprobs == 21
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=-2)  # (-1 is vLLM's "the whole vocabulary": test_llm_vllm_port)


def test_top_counts_differ_per_row() -> None:
    raw = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    got = token_logprobs(raw, [0, 0], [2, 0])
    lp = torch.log_softmax(raw, dim=-1)
    assert got[0][0] == pytest.approx(float(lp[0, 0]))
    assert [t for t, _ in got[0][1]] == [3, 2]
    assert got[1] == (pytest.approx(float(lp[1, 0])), [])


def _hf_prompt_logprobs(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 16}, {"enable_chunked_prefill": False}],
    ids=["whole", "chunks-of-16", "no-chunking"],
)
def test_prompt_logprobs_equal_transformers(setup: dict[str, Any], engine_args: Any) -> None:
    """Each prompt token after the first: its logprob given those before it, and the most
    likely alternatives; a prompt already in the prefix cache is computed again for them."""
    llm = LLM(model=str(setup["path"]), num_kv_blocks=256, **engine_args)
    prompts = random_prompts(3, 512, seed=21)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts, plain)  # now cached
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.num_cached_tokens == 0 and out.logprobs is None
        lps = out.prompt_logprob_entries
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        ref = _hf_prompt_logprobs(setup["hf"], prompt)
        for p in range(1, len(prompt)):
            entry = lps[p]
            assert entry is not None
            assert entry[0] == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
            assert [t for t, _ in entry[1]] == ref[p - 1].topk(2).indices.tolist()
            chosen = ref[p - 1, prompt[p]]  # its rank: tokens at least as likely (within fp noise)
            above, tied = ref[p - 1] > chosen + 1e-4, ref[p - 1] >= chosen - 1e-4
            assert int(above.sum()) + 1 <= entry[2] <= int(tied.sum())
            shaped = out.prompt_logprobs[p]  # vLLM's shape: the token, then its alternatives
            assert shaped is not None and next(iter(shaped)) == prompt[p]
            assert shaped[prompt[p]].logprob == entry[0] and shaped[prompt[p]].rank == entry[2]
            for i, (alt, alt_lp) in enumerate(entry[1]):
                assert shaped[alt].logprob == alt_lp
                assert shaped[alt].rank == (entry[2] if alt == prompt[p] else i + 1)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert out.token_ids == setup["llm"].generate([prompt], plain)[0].token_ids
    llm.engine.check_integrity()
