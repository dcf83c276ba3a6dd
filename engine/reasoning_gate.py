"""Structured output that starts after a reasoning model's thoughts (vLLM's behaviour with a
reasoning parser: the model thinks freely, the structure constrains its answer).

`ReasoningGate` wraps a grammar matcher and has its interface (`accept_token`,
`fill_next_token_bitmask`, `is_terminated`), so the sampler and the output processor need not
know. Its state, from the prompt and then from each sampled token:
- `thinking`: the prompt opened thoughts it did not close (e.g. DeepSeek-R1's template ends in
  `<think>`): every token is allowed, none reaches the grammar, until the close tag's tokens
  have been sampled;
- `start`: the reply may open thoughts itself (Qwen3): the grammar's tokens are allowed, and
  the open tag's token; sampling that token starts `thinking`, any other is the answer's first;
- `answer`: the grammar constrains every token. Also from the start when the prompt ends in
  thoughts it closed (a template with thinking off writes `<think>\n\n</think>\n\n` last,
  e.g. Qwen3's with `enable_thinking: false`), as vLLM's parser then reads reasoning as ended.
Only a one-token open tag can start thoughts in the reply (the tags of Qwen3 and DeepSeek-R1 are
single tokens in their tokenizers); with a longer one the reply starts as the answer. The same
tokens always give the same state, so a request that moves between engines (prefill to decode)
is replayed into the same state by `accept_token`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

THINKING, START, ANSWER = "thinking", "start", "answer"
CLOSED_AT_END_TOKENS = 2
"""How many tokens (the template's "\n\n") may follow a close tag that ends the prompt's
thoughts for the reply to be the answer from its first token. An earlier turn's closed
thoughts are followed by its answer and the next turns: the reply may open thoughts then."""


def _last_index(tokens: Sequence[int], tag: Sequence[int]) -> int:
    """Where the last occurrence of `tag` starts in `tokens` (-1: nowhere)."""
    n, first, whole = len(tag), tag[0], list(tag)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i] == first and list(tokens[i : i + n]) == whole:  # (a long prompt: no slices)
            return i
    return -1


def prompt_opens_thoughts(
    prompt_token_ids: Sequence[int], open_ids: Sequence[int], close_ids: Sequence[int]
) -> bool:
    """Whether the prompt opened thoughts it did not close (a thinking model's template that
    ends in `<think>`): the reply then starts inside them."""
    if not open_ids or not close_ids:
        return False
    return _prompt_state(prompt_token_ids, open_ids, close_ids) == THINKING


def _prompt_state(
    prompt_token_ids: Sequence[int], open_ids: Sequence[int], close_ids: Sequence[int]
) -> str | None:
    """THINKING where the prompt opened thoughts it did not close, ANSWER where it ends in
    thoughts it closed (`CLOSED_AT_END_TOKENS`), else None (the reply decides)."""
    opened = _last_index(prompt_token_ids, open_ids)
    closed = _last_index(prompt_token_ids, close_ids)
    if opened >= 0 and opened > closed:
        return THINKING
    after = len(prompt_token_ids) - closed - len(close_ids)
    if closed > opened and after <= CLOSED_AT_END_TOKENS:
        return ANSWER
    return None


class ReasoningGate:
    def __init__(
        self,
        matcher: Any,
        open_ids: Sequence[int],
        close_ids: Sequence[int],
        prompt_token_ids: Sequence[int],
    ) -> None:
        if not open_ids or not close_ids:
            raise ValueError("reasoning tags must encode to at least one token each")
        self.matcher = matcher
        self._open = list(open_ids)
        self._close = list(close_ids)
        self._recent: list[int] = []  # the last tokens sampled while thinking
        self.state = _prompt_state(prompt_token_ids, self._open, self._close) or (
            START if len(self._open) == 1 else ANSWER
        )

    def accept_token(self, token: int) -> bool:
        if self.state == ANSWER:
            return bool(self.matcher.accept_token(token))
        if self.state == START:
            if token == self._open[0]:
                self.state = THINKING
                return True
            self.state = ANSWER
            return bool(self.matcher.accept_token(token))
        self._recent = (self._recent + [token])[-len(self._close) :]
        if self._recent == self._close:
            self.state = ANSWER
        return True

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> None:
        if self.state == THINKING:
            bitmask[index].fill_(-1)  # every bit set: every token allowed
            return
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if self.state == START:
            word, bit = divmod(self._open[0], 32)
            value = int(bitmask[index, word]) | (1 << bit)
            bitmask[index, word] = value - (1 << 32) if value >= 1 << 31 else value  # (int32)

    def is_terminated(self) -> bool:
        return self.state == ANSWER and bool(self.matcher.is_terminated())
