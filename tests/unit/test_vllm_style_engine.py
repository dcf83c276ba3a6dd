"""`llm.llm_engine` is driven as vLLM's `LLMEngine` is (its `llm_engine_example.py` loop):
`add_request(request_id, prompt, params)`, `step()` returning `RequestOutput`s, until
`has_unfinished_requests()` is false; the results equal `LLM.generate`'s."""

from __future__ import annotations

from typing import Any

import pytest

from tandem import LLM, RequestOutputKind, SamplingParams, TokensPrompt
from tandem.engine.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(model=str(tiny_checkpoint()), num_kv_blocks=128)


def run(llm: LLM, prompts: list[tuple[str, Any, SamplingParams]]) -> list[Any]:
    engine = llm.llm_engine
    for request_id, prompt, params in prompts:
        engine.add_request(request_id, prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    return seen


def test_the_example_loop_gives_generates_outputs(llm: LLM) -> None:
    want = llm.generate(["hello there", [5, 6, 7]], GREEDY)
    sampled = SamplingParams(n=2, seed=7, max_tokens=4, ignore_eos=True)
    want_n = llm.generate("more", sampled)[0]
    seen = run(llm, [("a", "hello there", GREEDY), ("b", TokensPrompt(prompt_token_ids=[5, 6, 7]),
                     GREEDY), ("c", "more", sampled)])  # fmt: skip
    final = {o.request_id: o for o in seen if o.finished}
    assert sorted(final) == ["a", "b", "c"]
    for request_id, out in zip("ab", want, strict=True):
        got = final[request_id]
        assert got.outputs[0].token_ids == out.outputs[0].token_ids
        assert got.outputs[0].text == out.outputs[0].text
        assert got.prompt == out.prompt and got.prompt_token_ids == out.prompt_token_ids
    assert [s.token_ids for s in final["c"].outputs] == [s.token_ids for s in want_n.outputs]
    assert [s.index for s in final["c"].outputs] == [0, 1]
    # cumulative: every step's output of "a" holds all its tokens so far, one more each time
    lengths = [len(o.outputs[0].token_ids) for o in seen if o.request_id == "a"]
    assert lengths == list(range(1, 7))
    assert not llm.engine.requests


def test_delta_and_final_only_outputs(llm: LLM) -> None:
    want = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0]
    delta = GREEDY.clone()
    delta.output_kind, delta.prompt_logprobs = RequestOutputKind.DELTA, 1
    final = GREEDY.clone()
    final.output_kind = RequestOutputKind.FINAL_ONLY
    seen = run(llm, [("d", "hello", delta), ("f", "hello", final)])
    deltas = [o for o in seen if o.request_id == "d"]
    assert [t for d in deltas for t in d.outputs[0].token_ids] == want.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == want.text
    assert [d.token_ids for d in deltas] == [d.outputs[0].token_ids for d in deltas]
    assert deltas[0].prompt_logprobs and not any(d.prompt_logprobs for d in deltas[1:])
    finals = [o for o in seen if o.request_id == "f"]
    assert len(finals) == 1 and finals[0].outputs[0].token_ids == want.token_ids


def test_text_a_stop_string_cuts_is_never_sent(llm: LLM) -> None:
    """A stop string over several tokens: what it cuts off was not in an earlier output (the
    deltas added up to more than the final text, and cumulative text shrank)."""
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate("hello", long, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # (spans tokens, mid-output)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    want = llm.generate("hello", params, use_tqdm=False)[0].outputs[0].text
    assert len(want) < len(text)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        stopping = params.clone()
        stopping.output_kind = kind
        texts = [o.outputs[0].text for o in run(llm, [("s", "hello", stopping)])]
        if kind == RequestOutputKind.DELTA:
            assert "".join(texts) == want
        else:
            assert texts[-1] == want and all(want.startswith(t) for t in texts)


def test_requests_generate_finishes_are_counted_and_reported(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("mine", "hello", GREEDY)
    assert engine.get_num_unfinished_requests() == 1
    llm.generate("other", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 1
    (out,) = engine.step()  # (it finished in generate's steps: reported now)
    assert out.request_id == "mine" and out.finished
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()


def test_abort_and_bad_requests(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("x", "hello", SamplingParams(max_tokens=50, n=3))
    assert engine.get_num_unfinished_requests() == 3
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", "hello", GREEDY)
    engine.abort_request(["x"])
    assert not engine.has_unfinished_requests() and not llm.engine.requests
    with pytest.raises(InvalidRequestError, match="takes \\(request_id, prompt, params\\)"):
        engine.add_request("hello", GREEDY)  # type: ignore[arg-type]  # (tandem's old order)
    with pytest.raises(InvalidRequestError, match="token-id prompts are lists of ints"):
        engine.add_request("y", {"prompt_token_ids": ["a"]}, GREEDY)
    llm.engine.check_integrity()


def test_model_config_reads_as_vllms(llm: LLM) -> None:
    config = llm.llm_engine.model_config
    assert config.get_vocab_size() == llm.engine.spec.vocab_size
    assert config.hf_config.num_hidden_layers == llm.engine.spec.num_layers  # (transformers')
    assert config.max_model_len == llm.engine.max_model_len
    assert llm.llm_engine.get_model_config() is config
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()


def test_model_config_of_a_checkpoint_transformers_cannot_read(
    tiny_checkpoint: Any, tmp_path: Any
) -> None:
    """A config.json without model_type (tandem reads its architectures) still has a
    model_config (transformers' AutoConfig refuses it: every field raised)."""
    import json
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), path)
    config = json.loads((path / "config.json").read_text())
    del config["model_type"]
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), num_kv_blocks=32)
    assert llm.llm_engine.model_config.max_model_len == llm.engine.max_model_len
    assert llm.llm_engine.model_config.hf_config is llm.engine.spec
