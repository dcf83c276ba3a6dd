"""The benchmark's workloads: exact token lengths, shared prefixes, turns, the mixed shares."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.bench.serving.benchmark import DatasetOptions, make_conversations
from tandem.bench.serving.datasets import MixedSpec, mixed_dataset, num_requests
from tandem.bench.serving.prompts import TokenPrompts, WordPrompts


@pytest.fixture(scope="module")
def tokens(tiny_checkpoint: Callable[..., Path]) -> TokenPrompts:
    return TokenPrompts.from_pretrained(tiny_checkpoint())


def test_random_prompts_have_exact_token_lengths_within_the_range(tokens: TokenPrompts) -> None:
    opts = DatasetOptions("random", 50, random_input_len=100, random_output_len=20,
                          random_range_ratio=0.5)  # fmt: skip
    convs = make_conversations(opts, tokens, seed=0)
    lengths = [len(c.turns[0].user) for c in convs]
    assert len(convs) == 50 and min(lengths) >= 50 and max(lengths) <= 150
    assert all(10 <= c.turns[0].output_len <= 30 for c in convs)
    special = set(tokens.tokenizer.hf.all_special_ids)
    assert not special & {t for c in convs for t in c.turns[0].user}  # type: ignore[union-attr]
    assert make_conversations(opts, tokens, seed=0)[0].turns == convs[0].turns  # seeded


def test_shared_prefix_groups_share_their_system_prompt(tokens: TokenPrompts) -> None:
    opts = DatasetOptions("shared-prefix", sp_num_groups=3, sp_prompts_per_group=4,
                          sp_system_prompt_len=64, sp_question_len=8, sp_output_len=5)  # fmt: skip
    convs = make_conversations(opts, tokens, seed=1)
    prefixes = Counter(tuple(c.prefix) for c in convs)  # type: ignore[arg-type]
    assert sorted(prefixes.values()) == [4, 4, 4] and all(len(p) == 64 for p in prefixes)
    assert all(len(c.turns[0].user) == 8 for c in convs)


def test_multi_turn_conversations_add_up_to_num_prompts() -> None:
    opts = DatasetOptions("multi-turn", 10, mt_num_turns=4, mt_first_len=20, mt_turn_len=5)
    convs = make_conversations(opts, WordPrompts(), seed=0)
    assert [len(c.turns) for c in convs] == [4, 4, 2] and num_requests(convs) == 10
    assert [WordPrompts().length(t.user) for t in convs[0].turns] == [20, 5, 5, 5]


def test_mixed_traffic_has_the_seeds_four_kinds_in_their_shares(tokens: TokenPrompts) -> None:
    convs = mixed_dataset(tokens, random.Random(0), 400, MixedSpec(scale=0.5))
    assert num_requests(convs) == 400
    kinds = Counter(c.category for c in convs for _ in c.turns)
    assert set(kinds) == {"short", "rag", "agent", "chat"}
    assert 0.6 < kinds["short"] / 400 < 0.75
    rag = next(c for c in convs if c.category == "rag")
    assert (len(rag.turns[0].user), rag.turns[0].output_len) == (384, 8)
    chats = [c for c in convs if c.category == "chat"]
    assert all(c.prefix == chats[0].prefix and len(c.prefix) == 256 for c in chats)
    assert max(len(c.turns) for c in chats) == 3
