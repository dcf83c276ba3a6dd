"""Penalties: `repetition_penalty` gives transformers' greedy tokens; presence and frequency
penalties follow OpenAI's rule against a step-by-step reference on transformers' logits; through
a transfer (prefill in one engine, decode in another) the tokens are the colocated engine's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError
from tandem.engine.penalties import bad_word_sequences
from tests.hf_reference import hf_last_logits, load_hf_model, random_prompts
from tests.kv_protocol_pair import Pair, colocated, model, prompt_of  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def setup(tiny_checkpoint: Any) -> dict[str, Any]:
    path = tiny_checkpoint(arch="llama", seed=6)
    return {"path": path, "hf": load_hf_model(path), "llm": LLM(model=str(path), num_kv_blocks=256)}


def test_repetition_penalty_equals_transformers_greedy(setup: dict[str, Any]) -> None:
    prompts = random_prompts(4, 512, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    outs = setup["llm"].generate(prompts, params)
    plain = setup["llm"].generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt])
            ref = (
                setup["hf"]
                .generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=12,
                    repetition_penalty=1.8,
                )[0, len(prompt) :]
                .tolist()
            )
            assert out.token_ids == ref
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # it did something


def _openai_reference(
    hf: Any, prompt: list[int], steps: int, presence: float, frequency: float
) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        logits = hf_last_logits(hf, prompt + out).clone()
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    ("presence", "frequency"), [(1.5, 0.0), (0.0, 0.7), (0.4, 0.9), (-1.0, 0.0)]
)
def test_presence_and_frequency_penalties_follow_openai_s_rule(
    setup: dict[str, Any], presence: float, frequency: float
) -> None:
    prompt = random_prompts(1, 512, seed=11)[0]
    params = SamplingParams(
        temperature=0,
        max_tokens=10,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logprobs=0,
    )
    out = setup["llm"].generate([prompt], params)[0]
    assert out.token_ids == _openai_reference(setup["hf"], prompt, 10, presence, frequency)
    plain = _openai_reference(setup["hf"], prompt, 10, 0.0, 0.0)
    assert out.token_ids != plain  # (the prompt's greedy output repeats tokens)
    # logprobs stay those of the model's own logits
    assert out.logprobs is not None
    first = torch.log_softmax(hf_last_logits(setup["hf"], prompt), dim=-1)
    assert out.logprobs[0][0] == pytest.approx(float(first[out.token_ids[0]]), abs=1e-4)


def test_penalties_are_bounded() -> None:
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_penalties_continue_exactly_across_a_transfer(model: str, colocated: LLM) -> None:  # noqa: F811
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5
    )
    prompt = prompt_of(16 * 4 + 7, start=5)
    pair = Pair(model)
    pair.start("p", prompt, params)
    events = pair.pump()
    first = next(e.token_ids for e in events if e.kind == "first_token")
    want = colocated.generate([prompt], params)[0].token_ids
    assert list(first) + pair.decode_all()["p"] == want
    plain = params.model_copy(update={"repetition_penalty": 1.0, "frequency_penalty": 0.0})
    assert colocated.generate([prompt], plain)[0].token_ids != want
    pair.idle()


def test_logit_bias_steers_greedy_decoding(setup: dict[str, Any]) -> None:
    prompt = random_prompts(1, 512, seed=12)[0]
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={77: 100.0})
    assert setup["llm"].generate([prompt], forced)[0].token_ids == [77, 77, 77, 77]
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = setup["llm"].generate([prompt], plain)[0].token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100.0}, logprobs=0)
    out = setup["llm"].generate([prompt], banned)[0]
    assert out.token_ids[0] != first
    ref = torch.log_softmax(hf_last_logits(setup["hf"], prompt), dim=-1)
    assert out.token_ids[0] == int(ref.topk(2).indices[1])  # the runner-up
    assert SamplingParams(logit_bias={1: 150.0}).logit_bias == {1: 150.0}  # (offline: any, as vLLM)
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias={1: float("inf")})


def test_allowed_token_ids_restrict_sampling(setup: dict[str, Any]) -> None:
    """vLLM's `allowed_token_ids`: greedy picks the likeliest allowed token (transformers'
    logits), sampling stays inside the set; an empty set or a negative id is refused."""
    prompt = random_prompts(1, 512, seed=13)[0]
    allowed = [5, 77, 301]
    greedy = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed)
    first = setup["llm"].generate([prompt], greedy)[0].token_ids[0]
    ref = hf_last_logits(setup["hf"], prompt)
    assert first == allowed[int(ref[allowed].argmax())]
    sampled = SamplingParams(
        temperature=1.5, seed=2, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
    )
    tokens = setup["llm"].generate([prompt], sampled)[0].token_ids
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1
    for bad in ([], [-1]):
        with pytest.raises(InvalidRequestError):
            SamplingParams(allowed_token_ids=bad)


def test_bad_words_are_never_completed(setup: dict[str, Any]) -> None:
    """vLLM's `bad_words`: a word of the greedy output, banned, does not come out (as written,
    nor after a space where that makes a word of its own), and the output changes only from
    where it would have."""
    llm = setup["llm"]
    tok = llm.engine.tokenizer
    prompts = random_prompts(6, 512, seed=21)
    base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    checked = 0
    for prompt, plain in zip(prompts, llm.generate(prompts, base), strict=True):
        ids = plain.token_ids
        # two tokens in (a prefix to match first) whose text tokenizes back to them
        at = next(
            (
                i
                for i in range(2, len(ids) - 1)
                if tok.encode(tok.decode(ids[i : i + 2]), add_special_tokens=False)
                == ids[i : i + 2]
            ),
            None,
        )
        if at is None:
            continue
        word = tok.decode(ids[at : at + 2])
        out = llm.generate([prompt], base.model_copy(update={"bad_words": [word]}))[0].token_ids
        for seq in bad_word_sequences([word], lambda t: tok.encode(t, add_special_tokens=False)):
            assert not any(out[i : i + len(seq)] == seq for i in range(len(out))), (word, out)
        assert out[: at + 1] == ids[: at + 1] and out != ids
        checked += 1
    assert checked >= 2
    with pytest.raises(InvalidRequestError):
        SamplingParams(bad_words=[" "])


def test_a_bad_word_after_a_space_is_banned_where_vllm_bans_it() -> None:
    """vLLM bans " word" too only where it is a word token of its own: a first token other
    than the word's and as many tokens (so a one-token " token" is not banned for "token"
    written in two, nor " ab" that starts as "ab" does)."""
    ids = {"token": [324, 393], " token": [420], "red": [5], " red": [6], "ab": [1, 2],
           " ab": [1, 3], "xy": [7, 8], " xy": [9, 10]}  # fmt: skip
    assert bad_word_sequences(["token", " red", "ab", "xy", "red"], ids.__getitem__) == [
        [324, 393], [5], [6], [1, 2], [7, 8], [9, 10],
    ]  # fmt: skip
