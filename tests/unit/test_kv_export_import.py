"""Export a request's KV from one engine, import it into another, and continue exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError
from tandem.engine.llm_engine import LLMEngine
from tests.hf_reference import random_prompts


def _prefill(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    """Runs a request until its first token, keeping its KV for export."""
    engine.add_request(
        prompt, params.model_copy(update={"max_tokens": 1}), request_id=request_id, keep_kv=True
    )
    first: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                first.extend(out.new_token_ids)
    return first


def _decode_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint(arch="llama", seed=5))


def test_imported_request_continues_like_colocated(model_path: str) -> None:
    prompts = random_prompts(6, 512, seed=3, min_len=20, max_len=120, shared_prefix=48)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        o.token_ids for o in LLM(model=model_path, num_kv_blocks=256).generate(prompts, params)
    ]

    prefill = LLM(model=model_path, num_kv_blocks=256).engine
    decode = LLM(model=model_path, num_kv_blocks=256).engine
    firsts = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        firsts[rid] = _prefill(prefill, rid, prompt, params)
        kv = prefill.export_kv(rid)
        assert kv.num_tokens == len(prompt) and kv.num_blocks == (len(prompt) + 15) // 16
        req = decode.import_request(rid, kv, firsts[rid], params)
        # pages arrive byte-exact
        got = decode.kv_pool.export_blocks(req.block_table)
        assert torch.equal(got.view(torch.uint8), kv.data.view(torch.uint8))
        prefill.release_kv(rid)
        prefill.check_integrity()
    rest = _decode_all(decode)
    for i in range(len(prompts)):
        rid = f"r{i}"
        assert firsts[rid] + rest[rid] == expected[i], rid
    decode.check_integrity()
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_import_reuses_decode_side_prefix_blocks(model_path: str) -> None:
    prefix = list(range(1, 65))  # four full blocks
    prompts = [prefix + [100, 101, 102], prefix + [200, 201]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefill = LLM(model=model_path, num_kv_blocks=64).engine
    decode = LLM(model=model_path, num_kv_blocks=64).engine
    first = _prefill(prefill, "a", prompts[0], params)
    a = decode.import_request("a", prefill.export_kv("a"), first, params)
    assert a.num_prefix_hit_tokens == 0
    first_b = _prefill(prefill, "b", prompts[1], params)
    b = decode.import_request("b", prefill.export_kv("b"), first_b, params)
    assert b.num_prefix_hit_tokens == 64
    assert b.block_table[:4] == a.block_table[:4]
    assert decode.block_manager.ref_count(a.block_table[0]) == 2
    decode.check_integrity()
    _decode_all(decode)
    decode.check_integrity()


def test_import_refuses_other_namespace(model_path: str, tiny_checkpoint: Any) -> None:
    other = LLM(model=str(tiny_checkpoint(arch="llama", seed=6)), num_kv_blocks=64).engine
    prefill = LLM(model=model_path, num_kv_blocks=64).engine
    params = SamplingParams(temperature=0, max_tokens=4)
    first = _prefill(prefill, "x", [1, 2, 3, 4, 5], params)
    with pytest.raises(InvalidRequestError, match="namespace"):
        other.import_request("x", prefill.export_kv("x"), first, params)
    other.check_integrity()
    assert other.block_manager.num_free_blocks == 64


def test_seeded_sampler_state_travels(model_path: str) -> None:
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    expected = LLM(model=model_path, num_kv_blocks=64).generate([prompt], params)[0].token_ids
    prefill = LLM(model=model_path, num_kv_blocks=64).engine
    decode = LLM(model=model_path, num_kv_blocks=64).engine
    first = _prefill(prefill, "s", prompt, params)
    decode.import_request("s", prefill.export_kv("s"), first, params)
    assert first + _decode_all(decode)["s"] == expected


def test_releasing_the_kv_of_a_running_request_is_refused(model_path: str) -> None:
    """`release_kv` is for a finished `keep_kv` request: on one still running it freed the
    blocks while the scheduler went on computing into new ones (never-written KV that then
    went into the prefix cache, so a later request with that prefix came out wrong)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 40))
    expected = LLM(model=model_path, num_kv_blocks=64).generate([prompt], params)[0].token_ids
    engine = LLM(model=model_path, num_kv_blocks=64, max_num_batched_tokens=16).engine
    engine.add_request(prompt, params, request_id="x", keep_kv=True)
    engine.step()  # one chunk of the prompt
    with pytest.raises(ValueError, match="has not finished"):
        engine.release_kv("x")
    out: list[int] = []
    while engine.has_unfinished_requests():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == expected
    engine.release_kv("x")
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
