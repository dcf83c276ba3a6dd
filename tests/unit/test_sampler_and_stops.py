"""Sampling is reproducible per request; stops cut text exactly; streamed UTF-8 is never broken."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.output_text import OutputText
from tandem.engine.sampler import draw
from tests.hf_reference import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(model=str(tiny_checkpoint(arch="qwen2", seed=8)), num_kv_blocks=512)


def test_seeded_sampling_independent_of_batch(llm: LLM) -> None:
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=24, ignore_eos=True
    )
    alone = llm.generate([prompt], params)[0].token_ids
    others = random_prompts(12, 512, seed=1, max_len=80)
    mixed_params = [SamplingParams(temperature=1.3, max_tokens=30, ignore_eos=True)] * 6 + [
        SamplingParams(temperature=0.7, seed=7, max_tokens=5, ignore_eos=True)
    ] * 6
    outs = llm.generate(
        [*others[:5], prompt, *others[5:]], [*mixed_params[:5], params, *mixed_params[5:]]
    )
    assert outs[5].token_ids == alone
    again = llm.generate([prompt, prompt], [params, params])
    assert again[0].token_ids == again[1].token_ids == alone


@pytest.mark.parametrize(
    "extra", [{}, {"presence_penalty": 1.5, "frequency_penalty": 1.0}, {"bad_words": ["a"]}]
)
def test_a_seeded_request_resumed_from_its_first_tokens_goes_on_as_it_would_have(
    llm: LLM, extra: dict[str, Any]
) -> None:
    """What the router does when a request's decode worker dies mid-stream: a new request
    prefills the prompt and the k tokens sent, told they were its output (`resumed_tokens`).
    Its seeded draws and penalties go on from them: the rest is what the lost one would
    have sampled, token for token."""
    prompt = [5, 6, 7, 8, 9, 10]
    fields = dict(temperature=0.9, top_k=50, seed=42, ignore_eos=True, **extra)
    whole = llm.generate([prompt], SamplingParams(max_tokens=24, **fields))[0].token_ids
    for k in (1, 7):
        params = SamplingParams(max_tokens=24 - k, resumed_tokens=k, **fields)
        rest = llm.generate([prompt + whole[:k]], params)[0].token_ids
        assert rest == whole[k:], k
    unresumed = llm.generate([prompt + whole[:7]], SamplingParams(max_tokens=17, **fields))
    assert unresumed[0].token_ids != whole[7:]  # (what counting them changes)


def test_draw_samples_the_distribution_and_never_a_token_of_probability_zero() -> None:
    gen = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.125])
    counts = Counter(draw(probs, gen) for _ in range(40_000))
    assert counts[2] == 0 and set(counts) == {0, 1, 3, 4}
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 40_000 - p) < 0.01, (token, counts)
    edges = torch.tensor([0.0, 0.0, 1.0, 0.0])  # (zeros before and after the only token)
    assert {draw(edges, gen) for _ in range(2_000)} == {2}
    assert draw(edges, None) == 2
    wide = torch.zeros(152_000)
    wide[[7, 151_999]] = torch.tensor([0.25, 0.75])
    assert Counter(draw(wide, gen) for _ in range(4_000)).keys() == {7, 151_999}


def test_unseeded_sampling_varies_and_greedy_is_top_k_1(llm: LLM) -> None:
    prompt = [11, 12, 13]
    sampled = llm.generate(
        [prompt] * 4, SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    )
    assert len({tuple(o.token_ids) for o in sampled}) > 1
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    top1 = llm.generate(
        [prompt], SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)
    )
    assert greedy[0].token_ids == top1[0].token_ids


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-30, 9e-6, 0.0099])
def test_temperature_near_zero_samples_at_the_lowest_and_fails_nothing(
    llm: LLM, temperature: float
) -> None:
    """As vLLM: above 0 but under 0.01 it samples at 0.01 (dividing by less made inf logits,
    and the multinomial's error failed every request of the step); 0 stays greedy."""
    prompt, other = [11, 12, 13], [30, 31, 32, 33]
    tiny = SamplingParams(temperature=temperature, seed=5, max_tokens=12, ignore_eos=True)
    lowest = SamplingParams(temperature=0.01, seed=5, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    assert tiny.temperature == 0.01 and not tiny.greedy
    assert SamplingParams(temperature=0).greedy
    expected = llm.generate([prompt], lowest)[0].token_ids
    alone_other = llm.generate([other], sampled)[0].token_ids
    outs = llm.generate([prompt, other], [tiny, sampled])
    assert outs[0].token_ids == expected
    assert outs[1].token_ids == alone_other


def test_overflowing_repetition_penalty_samples_the_top_tokens(llm: LLM) -> None:
    """A repetition penalty near 0 divides positive logits into +inf: the step still samples
    (those tokens share the mass) instead of failing on NaN probabilities."""
    prompt = [11, 12, 13, 11, 12, 13]
    params = SamplingParams(
        temperature=1.0, repetition_penalty=1e-45, seed=1, max_tokens=6, ignore_eos=True
    )
    out = llm.generate([prompt, [40, 41]], [params, params])
    assert [len(o.token_ids) for o in out] == [6, 6]


def test_stop_string_cuts_text_across_token_boundaries(llm: LLM) -> None:
    prompt = [20, 21, 22, 23]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 12, "tiny model should produce some text"
    # pick a stop string that starts inside one token and ends inside a later one
    tokens = llm.tokenizer.hf.convert_ids_to_tokens(full.token_ids)
    assert tokens
    start = len(text) // 3
    stop = text[start : start + 6]
    first = text.find(stop)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0]
    assert kept.text == text[: first + len(stop)] and kept.token_ids == out.token_ids
    assert kept.finish_reason == "stop" and kept.stop_reason == stop


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = [30, 31, 32]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[
        0
    ].token_ids
    stop_tok = full[3]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == full[: full.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    late = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], min_tokens=10),
    )[0]
    assert len(late.token_ids) >= 10
    assert stop_tok not in late.token_ids[:9]


def test_a_stop_string_before_min_tokens_does_not_count(llm: LLM) -> None:
    """Written before `min_tokens` tokens were out, a stop string is not searched for later
    either (its text was already streamed: cutting there would make the final text shorter
    than the stream)."""
    engine: LLMEngine = llm.engine
    prompt = [50, 51, 52]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    early = engine.tokenizer.decode(full.token_ids[:2])
    stop = early[-3:] if len(early) >= 3 else early  # ends within the first 2 tokens' text
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, ignore_eos=True,
                            stop=[stop])  # fmt: skip
    req = engine.add_request(prompt, params, stream_text=True)
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(o.text_delta for o in engine.step() if o.request_id == req.request_id)
    out = engine.make_output(req)
    assert len(out.token_ids) >= 6
    assert "".join(deltas) == out.text
    assert out.text.startswith(early)


def test_a_longer_stop_string_in_the_list_does_not_widen_the_others_search(llm: LLM) -> None:
    """Each stop string must end in the text not searched yet: with a long one next to it, a
    short one written before `min_tokens` tokens were out was found one token later."""
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    decode = llm.engine.tokenizer.decode
    for first in range(40, 80):  # a prompt whose first output token writes text seen once
        prompt = [first, 51, 52]
        ids = llm.generate([prompt], SamplingParams(**greedy))[0].token_ids
        stop = decode(ids[:1])  # written by the first token
        text = decode(ids)
        if stop.strip() and text.startswith(stop) and stop not in text[len(stop) :]:
            break
    assert stop.strip() and decode(ids).count(stop) == 1, (stop, decode(ids))
    alone = llm.generate([prompt], SamplingParams(min_tokens=1, stop=[stop], **greedy))[0]
    both = SamplingParams(min_tokens=1, stop=[stop, "\x00" * 30], **greedy)
    out = llm.generate([prompt], both)[0]
    assert out.token_ids == alone.token_ids == ids and out.text == alone.text == decode(ids)
    assert out.finish_reason == "length"


def test_max_tokens_finish_length(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_streamed_text_never_breaks_utf8(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    text = "héllo wörld 你好世界 🙂🚀 ünïcödé"
    prompt = engine.tokenizer.encode(text)
    # Force the output to be the multi-byte text's own tokens: sample greedily from a prompt and
    # check the streamed deltas of a replayed sequence through the output processor.
    req = engine.add_request(
        [1, 2, 3],
        SamplingParams(temperature=0, max_tokens=len(prompt), ignore_eos=True),
        stream_text=True,
    )
    deltas = [engine.output_processor.process([req], [tok])[0].text_delta for tok in prompt]
    engine.abort(req.request_id)
    assert "".join(deltas) == engine.tokenizer.decode(prompt)
    assert all("\ufffd" not in d for d in deltas)
    engine.check_integrity()


def test_stream_deltas_concatenate_to_final_text(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    req = engine.add_request(
        [40, 41, 42],
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
        stream_text=True,
    )
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(o.text_delta for o in engine.step() if o.request_id == req.request_id)
    assert (
        "".join(deltas)
        == engine.make_output(req).text
        == engine.tokenizer.decode(req.output_token_ids)
    )


def test_min_p_keeps_the_tokens_transformers_keeps() -> None:
    """After temperature, min_p drops what transformers' MinPLogitsWarper drops, row by row."""
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper

    from tandem.engine.request import Request
    from tandem.engine.sampler import _probabilities

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 500, generator=gen) * 3
    settings = [(0.7, 0.1), (1.3, 0.3), (1.0, 0.0)]
    requests = [
        Request(f"r{i}", [1], SamplingParams(temperature=t, min_p=p), frozenset())
        for i, (t, p) in enumerate(settings)
    ]
    probs = _probabilities(logits.clone(), requests)
    for i, (t, p) in enumerate(settings):
        scaled = logits[i : i + 1] / t
        kept = scaled if p == 0 else MinPLogitsWarper(p)(None, scaled)  # type: ignore[arg-type]
        want = torch.softmax(kept, dim=-1)[0]
        assert torch.equal(probs[i] > 0, want > 0)
        assert torch.allclose(probs[i], want, atol=1e-6)
    assert 1 < int((probs[0] > 0).sum()) < 500 and int((probs[2] > 0).sum()) == 500


def test_min_p_one_samples_the_greedy_tokens(llm: LLM) -> None:
    prompts = random_prompts(3, 512, seed=4, max_len=40)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    sampled = llm.generate(
        prompts, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True)
    )
    assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


def test_special_tokens_write_text_only_when_not_skipped(llm: LLM) -> None:
    """vLLM's `skip_special_tokens` (default True): EOS, forced here by a logit bias and
    generated past with `ignore_eos`, adds nothing to the text unless it is False."""
    eos = llm.tokenizer.hf.eos_token_id
    eos_text = llm.tokenizer.hf.eos_token
    base = {"temperature": 0, "max_tokens": 3, "ignore_eos": True, "logit_bias": {eos: 100.0}}
    skipped, kept = llm.generate(
        [[5, 6, 7]] * 2,
        [SamplingParams(**base), SamplingParams(**base, skip_special_tokens=False)],
    )
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text == eos_text * 3


def test_a_stop_string_in_the_text_held_at_the_end_counts(llm: LLM) -> None:
    """The last token's incomplete character (held back by the detokenizer, written as U+FFFD
    when the request ends) is searched for stop strings too: a `max_tokens` end becomes a
    stop at the string, as it would one token later."""
    tokenizer = llm.engine.tokenizer
    lead = tokenizer.encode("中", add_special_tokens=False)[:1]  # (0xE4, a character's first byte)
    assert tokenizer.decode(lead) == "\ufffd"
    prompt = [5, 6, 7]
    params: dict[str, Any] = {"temperature": 0, "allowed_token_ids": lead, "ignore_eos": True}
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, **params))[0]
    assert (plain.text, plain.finish_reason) == ("\ufffd", "length")
    stopped = llm.generate([prompt], SamplingParams(max_tokens=1, stop=["\ufffd"], **params))[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == ("", "stop", "\ufffd")
    assert stopped.token_ids == lead
    kept = llm.generate(
        [prompt],
        SamplingParams(max_tokens=1, stop=["\ufffd"], include_stop_str_in_output=True, **params),
    )[0]
    assert (kept.text, kept.finish_reason) == ("\ufffd", "stop")
    llm.engine.check_integrity()


def test_the_stop_tokens_text_is_left_out_unless_asked_for(llm: LLM) -> None:
    """vLLM's rule: the text of the token a request stopped on (EOS or a `stop_token_ids`
    one) is not in `text` (the token is in `token_ids`), unless `include_stop_str_in_output`;
    with stop strings set or not, streamed or not."""
    prompt = [40, 41, 42]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ids = base[0].token_ids
    stop_id = ids[2]
    tokenizer = llm.engine.tokenizer
    for keep in (False, True):
        want = OutputText.after(tokenizer, prompt, ids[: 3 if keep else 2])
        want.flush()
        for stops in (None, ["never-matches"]):
            fields: dict[str, Any] = {"stop": stops, "include_stop_str_in_output": keep}
            params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id], **fields)
            out = llm.generate([prompt], params)[0]
            assert (out.token_ids, out.stop_reason) == (ids[:3], stop_id)
            assert out.text == want.text, (keep, stops)
            engine: LLMEngine = llm.engine
            req = engine.add_request(prompt, params, stream_text=True)
            deltas = []
            while engine.has_unfinished_requests():
                deltas.extend(o.text_delta for o in engine.step() if o.request_id == req.request_id)
            assert "".join(deltas) == want.text


def test_a_stop_string_completed_by_the_min_tokens_th_token_does_not_count(llm: LLM) -> None:
    """vLLM searches from the token after the first `min_tokens`: a string that token k
    completes does not stop a request with `min_tokens=k` (it may stop at k + 1 on)."""
    prompt, k = [60, 61, 62], 4
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    ids = llm.generate([prompt], SamplingParams(**greedy))[0].token_ids
    decode = llm.engine.tokenizer.decode
    stop = decode(ids[:k])[-2:]
    # (the fixed checkpoint and prompt give one: a string that token k alone completes)
    assert stop and stop not in decode(ids[: k - 1]), (stop, decode(ids[:k]))
    at_k = llm.generate([prompt], SamplingParams(min_tokens=k - 1, stop=[stop], **greedy))[0]
    assert len(at_k.token_ids) == k and at_k.stop_reason == stop  # (k > min_tokens: it counts)
    out = llm.generate([prompt], SamplingParams(min_tokens=k, stop=[stop], **greedy))[0]
    assert len(out.token_ids) > k and out.text.startswith(decode(ids[:k]))


def test_min_tokens_keeps_eos_out_with_ignore_eos_too(llm: LLM) -> None:
    """As vLLM's min-tokens processor: EOS is kept out of the first `min_tokens` tokens whatever
    `ignore_eos` says (ignore_eos only keeps it from ending the request)."""
    eos = sorted(llm.engine.eos_token_ids)[0]
    pushed = {"temperature": 0, "max_tokens": 4, "logit_bias": {eos: 100}, "ignore_eos": True}
    out = llm.generate([[10, 11]], SamplingParams(min_tokens=3, **pushed))[0].token_ids
    assert len(out) == 4 and eos not in out[:3] and out[3] == eos, out
    assert llm.generate([[10, 11]], SamplingParams(**pushed))[0].token_ids == [eos] * 4


def test_stop_reason_names_every_stop_token_but_the_tokenizers_eos(llm: LLM) -> None:
    """As vLLM: the tokenizer's EOS (<|endoftext|>, 0) ends a request with no stop_reason; the
    model's other end token from generation_config.json (<|im_end|>, 2) and stop_token_ids are
    named, and with ignore_eos only stop_token_ids stop it."""
    greedy = {"temperature": 0, "max_tokens": 3}

    def stopped(token: int, **fields: Any) -> tuple[list[int], str | None, int | str | None]:
        params = SamplingParams(logit_bias={token: 100}, **greedy, **fields)
        out = llm.generate([[10, 11]], params)[0]
        return out.token_ids, out.finish_reason, out.stop_reason

    assert stopped(0) == ([0], "stop", None)
    assert stopped(2) == ([2], "stop", 2)
    assert stopped(0, stop_token_ids=[0]) == ([0], "stop", None)  # (EOS is read first)
    assert stopped(0, stop_token_ids=[0], ignore_eos=True) == ([0], "stop", 0)
    assert stopped(2, ignore_eos=True) == ([2, 2, 2], "length", None)
