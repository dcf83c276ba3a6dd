"""Reasoning models' thinking, apart from the answer (vLLM's `--reasoning-parser`).

Qwen3 (thinking on) and DeepSeek-R1 write their thoughts between `<think>` and `</think>`, then
the answer. With a reasoning parser configured (`router.reasoning_parser`), a chat reply's
thoughts go to `reasoning_content` and the rest to `content` (and to the tool-call parser):
- `qwen3`: thoughts only when the reply opens with `<think>` (thinking off: all content), or
  when the prompt opened them (`inside`: Qwen3's thinking-only checkpoints' templates end in
  `<think>`, as the router finds in each prompt);
- `deepseek_r1`: the chat template opens `<think>` itself, so the reply starts inside the
  thoughts (an opening tag it writes anyway is dropped).
A reply cut short before `</think>` is all thoughts. Under structured output the model thinks
freely and the structure constrains the answer (the router sets `SamplingParams.reasoning_tags`;
`engine/reasoning_gate.py`), as vLLM does. Streamed, each delta is split the same way
(`ReasoningStream`), holding back only a tail that may be the start of a tag.
"""

from __future__ import annotations

from typing import Literal

from tandem.router.tool_parsers import tail_prefix_len

REASONING_PARSERS = ("qwen3", "deepseek_r1")
ReasoningParserName = Literal["qwen3", "deepseek_r1"]
OPEN, CLOSE = "<think>", "</think>"
REASONING_TAGS = (OPEN, CLOSE)  # both parsers' (`SamplingParams.reasoning_tags`)


class ReasoningParser:
    """Splits replies of a model family into (thoughts, answer)."""

    def __init__(self, name: ReasoningParserName) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}: one of {REASONING_PARSERS}")
        self.name = name
        self.starts_inside = name == "deepseek_r1"

    def inside(self) -> ReasoningParser:
        """This parser for a reply whose prompt opened its thoughts: it starts inside them."""
        parser = ReasoningParser(self.name)
        parser.starts_inside = True
        return parser

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished reply; None for an empty part."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


class ReasoningStream:
    """One streamed reply: `feed` splits each delta into (reasoning, content) that can go out
    now; `finish` gives what was held back."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._state = "start"  # -> "thinking" -> "answer"
        self._held = ""
        self._starts_inside = parser.starts_inside

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._state == "start":
            head = self._held.lstrip()
            if OPEN.startswith(head) and len(head) < len(OPEN):
                return "", ""  # may still open with the tag
            if head.startswith(OPEN):
                self._held, self._state = head[len(OPEN) :], "thinking"
            else:
                self._state = "thinking" if self._starts_inside else "answer"
        if self._state == "thinking":
            end = self._held.find(CLOSE)
            if end < 0:
                keep = tail_prefix_len(self._held, CLOSE)
                cut = len(self._held) - keep
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return reasoning, ""
            reasoning = self._held[:end]
            self._held, self._state = self._held[end + len(CLOSE) :], "answer"
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "thinking" or (self._state == "start" and self._starts_inside):
            return held, ""
        return "", held
