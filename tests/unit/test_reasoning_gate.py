"""Structured output after a reasoning model's thoughts (`SamplingParams.reasoning_tags`): free
tokens while the model thinks, the grammar's once the close tag is sampled; the same over a
prefill -> decode transfer. The tiny tokenizer has no think tokens, so one-byte tags stand in
for them (any tags work; Qwen3's and DeepSeek-R1's are single tokens too)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.reasoning_gate import ANSWER, START, THINKING, ReasoningGate
from tests.pd_pair import pd_pair, run_pd

TAGS = ("@", "~")
CHOICE = {"choice": ["yes", "no"]}


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint())


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(model=model, num_kv_blocks=64)


@pytest.fixture(scope="module")
def tags(llm: LLM) -> tuple[int, int]:
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in TAGS]
    assert all(len(i) == 1 for i in ids)
    return ids[0][0], ids[1][0]


def params(**extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **extra)


def out(llm: LLM, prompt: list[int], p: SamplingParams) -> list[int]:
    return llm.generate([prompt], p)[0].token_ids


def test_thoughts_opened_by_the_prompt_are_free(llm: LLM, tags: tuple[int, int]) -> None:
    prompt = llm.tokenizer.encode("the model thinks") + [tags[0]]
    free = out(llm, prompt, params())
    assert tags[1] not in free  # (else the gate would close)
    assert out(llm, prompt, params(reasoning_tags=TAGS, **CHOICE)) == free
    constrained = llm.generate([prompt], params(**CHOICE))[0]
    assert constrained.text in ("yes", "no") and constrained.token_ids != free


def test_the_answer_after_the_close_tag_follows_the_grammar(
    llm: LLM, tags: tuple[int, int]
) -> None:
    prompt = llm.tokenizer.encode("the model thinks") + [tags[0]]
    bias = {"logit_bias": {tags[1]: 100.0}}  # the model closes its thoughts at once
    gated = llm.generate([prompt], params(reasoning_tags=TAGS, **CHOICE, **bias))[0]
    answer = out(llm, prompt + [tags[1]], params(**CHOICE, **bias))
    assert gated.token_ids == [tags[1], *answer]
    assert gated.finish_reason == "stop"
    assert llm.tokenizer.decode(answer) in ("yes", "no")


def test_a_reply_may_open_thoughts_with_the_one_token_open_tag(
    llm: LLM, tags: tuple[int, int]
) -> None:
    prompt = llm.tokenizer.encode("answer at once")
    bias = {"logit_bias": {tags[0]: 100.0}}
    assert out(llm, prompt, params(reasoning_tags=TAGS, **CHOICE, **bias)) == [tags[0]] * 6
    refused = llm.generate([prompt], params(**CHOICE, **bias))[0]  # no tags: the grammar's
    assert refused.text in ("yes", "no")
    plain = llm.generate([prompt], params(reasoning_tags=TAGS, **CHOICE))[0]  # no thoughts
    assert plain.text == llm.generate([prompt], params(**CHOICE))[0].text


def test_multi_token_tags_close_thoughts_but_cannot_open_them(llm: LLM) -> None:
    think = ("<think>", "</think>")
    assert len(llm.tokenizer.encode("<think>", add_special_tokens=False)) > 1
    prompt = llm.tokenizer.encode("the model thinks")
    free = out(llm, prompt + llm.tokenizer.encode("<think>", add_special_tokens=False), params())
    opened = prompt + llm.tokenizer.encode("<think>", add_special_tokens=False)
    assert out(llm, opened, params(reasoning_tags=think, **CHOICE)) == free
    answer = llm.generate([prompt], params(reasoning_tags=think, **CHOICE))[0]
    assert answer.text in ("yes", "no")


def test_a_transferred_request_continues_in_the_same_state(
    model: str,
    llm: LLM,
    tags: tuple[int, int],
) -> None:
    prompt = llm.tokenizer.encode("the model thinks") + [tags[0]]
    closed = params(reasoning_tags=TAGS, **CHOICE, logit_bias={tags[1]: 100.0})
    with pd_pair(model) as (prefill, decode):
        for p in (params(reasoning_tags=TAGS, **CHOICE), closed):
            tokens, text, last, outcome = asyncio.run(run_pd(prefill, decode, "g", prompt, p))
            expected = llm.generate([prompt], p)[0]
            assert (tokens, text, last["finish_reason"]) == (
                expected.token_ids,
                expected.text,
                expected.finish_reason,
            )
            assert outcome["status"] == "sent"


class FakeMatcher:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.accepted.append(token)
        return token != 99

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].fill_(0)

    def is_terminated(self) -> bool:
        return len(self.accepted) >= 2


def test_the_gate_states_and_bitmask() -> None:
    inner = FakeMatcher()
    earlier_turn = [1, 63, 2, 7, 8, 4, 4, 4]  # thoughts closed, then more turns
    gate = ReasoningGate(inner, [63], [7, 8], prompt_token_ids=earlier_turn)
    assert gate.state == START
    mask = torch.zeros((2, 2), dtype=torch.int32)
    gate.fill_next_token_bitmask(mask, 1)
    assert mask[1].tolist() == [0, -(2**31)]  # only the open tag's bit (63: word 1, bit 31)
    assert gate.accept_token(63) and gate.state == THINKING and inner.accepted == []
    gate.fill_next_token_bitmask(mask, 0)
    assert mask[0].tolist() == [-1, -1]
    for t in (7, 9, 7, 8):
        assert gate.accept_token(t)
    assert gate.state == ANSWER and inner.accepted == [] and not gate.is_terminated()
    assert not gate.accept_token(99) and gate.accept_token(5) and gate.is_terminated()
    assert ReasoningGate(FakeMatcher(), [63], [7], [1, 63, 2]).state == THINKING
    # thinking off: the template closed the thoughts last ("<think>\n\n</think>\n\n"), so
    # the grammar holds from the first token (the open tag was allowed: the model could escape)
    for closed_last in ([1, 63, 2, 7, 8], [1, 63, 2, 7, 8, 4, 4], [63, 7, 8, 4]):
        assert ReasoningGate(FakeMatcher(), [63], [7, 8], closed_last).state == ANSWER
    assert ReasoningGate(FakeMatcher(), [6, 3], [7], [1, 2]).state == ANSWER
    with pytest.raises(ValueError, match="at least one token"):
        ReasoningGate(FakeMatcher(), [], [7], [])
