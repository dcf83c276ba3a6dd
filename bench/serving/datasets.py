"""Workloads as conversations: a single-turn request is a conversation of one turn.

A turn's prompt is the conversation's `prefix`, then every earlier turn's user part and the
server's reply to it, then this turn's user part: multi-turn traffic reuses its growing history
(what a prefix cache and cache-aware routing are for).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tandem.bench.serving.prompts import Prompt, PromptMaker

DATASETS = ("random", "shared-prefix", "multi-turn", "mixed")


@dataclass
class Turn:
    user: Prompt
    output_len: int


@dataclass
class Conversation:
    category: str
    turns: list[Turn]
    prefix: Prompt = field(default="")


def num_requests(conversations: list[Conversation]) -> int:
    return sum(len(c.turns) for c in conversations)


def _around(rng: random.Random, length: int, range_ratio: float) -> int:
    """Uniform in [length * (1 - r), length * (1 + r)], at least 1 (vLLM's random ranges)."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    maker: PromptMaker,
    rng: random.Random,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[Conversation]:
    """`num_prompts` random prompts; with `prefix_len`, all start with the same random
    prefix of that many tokens (vLLM's --random-prefix-len; `input_len` follows it)."""
    prefix = maker.random(rng, prefix_len) if prefix_len else ""
    return [
        Conversation(
            "random",
            [
                Turn(
                    maker.random(rng, _around(rng, input_len, range_ratio)),
                    _around(rng, output_len, range_ratio),
                )
            ],
            prefix,
        )
        for _ in range(num_prompts)
    ]


def shared_prefix_dataset(
    maker: PromptMaker,
    rng: random.Random,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
) -> list[Conversation]:
    """`num_groups` system prompts, each followed by `prompts_per_group` questions; shuffled."""
    out = []
    for _ in range(num_groups):
        system = maker.random(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            question = maker.random(rng, question_len)
            out.append(Conversation("shared-prefix", [Turn(question, output_len)], system))
    rng.shuffle(out)
    return out


def multi_turn_dataset(
    maker: PromptMaker,
    rng: random.Random,
    num_prompts: int,
    num_turns: int,
    first_len: int,
    turn_len: int,
    output_len: int,
    category: str = "multi-turn",
    prefix: Prompt = "",
) -> list[Conversation]:
    """Conversations of `num_turns` turns (the last one shorter) adding up to `num_prompts`."""
    out = []
    left = num_prompts
    while left > 0:
        n = min(num_turns, left)
        turns = [
            Turn(maker.random(rng, first_len if i == 0 else turn_len), output_len) for i in range(n)
        ]
        out.append(Conversation(category, turns, prefix))
        left -= n
    return out


@dataclass(frozen=True)
class MixedSpec:
    """The seed's mixed-traffic example (§11) scaled to a CPU: many short chats, a share of long
    RAG prompts, a code agent streaming long outputs, and a multi-turn support chat whose turns
    all start with one long shared prefix. `scale` multiplies every length."""

    short_share: float = 0.7
    short_input: tuple[int, int] = (32, 96)
    short_output: tuple[int, int] = (16, 32)
    rag_share: float = 0.1
    rag_input: int = 768
    rag_output: int = 16
    agent_share: float = 0.1
    agent_input: int = 128
    agent_output: int = 128
    chat_share: float = 0.1
    chat_prefix: int = 512
    chat_turns: int = 3
    chat_turn_len: int = 32
    chat_output: int = 16
    scale: float = 1.0

    def n(self, length: int) -> int:
        return max(1, round(length * self.scale))


def mixed_dataset(
    maker: PromptMaker, rng: random.Random, num_prompts: int, spec: MixedSpec = MixedSpec()
) -> list[Conversation]:
    """Conversations drawn by share until `num_prompts` requests (turns) are reached."""
    kinds = ("short", "rag", "agent", "chat")
    weights = (spec.short_share, spec.rag_share, spec.agent_share, spec.chat_share)
    chat_prefix = maker.random(rng, spec.n(spec.chat_prefix))
    out: list[Conversation] = []
    left = num_prompts
    while left > 0:
        kind = rng.choices(kinds, weights)[0]
        if kind == "short":
            n_in = rng.randint(*(spec.n(x) for x in spec.short_input))
            n_out = rng.randint(*(spec.n(x) for x in spec.short_output))
            conv = Conversation(kind, [Turn(maker.random(rng, n_in), n_out)])
        elif kind == "rag":
            conv = Conversation(
                kind, [Turn(maker.random(rng, spec.n(spec.rag_input)), spec.n(spec.rag_output))]
            )
        elif kind == "agent":
            conv = Conversation(
                kind,
                [Turn(maker.random(rng, spec.n(spec.agent_input)), spec.n(spec.agent_output))],
            )
        else:
            conv = multi_turn_dataset(
                maker,
                rng,
                min(spec.chat_turns, left),
                spec.chat_turns,
                spec.n(spec.chat_turn_len),
                spec.n(spec.chat_turn_len),
                spec.n(spec.chat_output),
                category=kind,
                prefix=chat_prefix,
            )[0]
        out.append(conv)
        left -= len(conv.turns)
    return out
