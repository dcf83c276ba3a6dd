"""One streamed chat reply's text, split as its parsers say: the thoughts apart (a reasoning
parser, `reasoning.py`), then, with tools, the content before a call as it comes and each call
as it is written (`call_stream.CallStream`)."""

from __future__ import annotations

from typing import Any

from tandem.router.call_stream import CallStream
from tandem.router.reasoning import ReasoningParser, ReasoningStream
from tandem.router.tool_parsers import ToolParser


class ReplyStream:
    def __init__(self, reasoning: ReasoningParser | None, calls: ToolParser | None) -> None:
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._calls = CallStream(calls) if calls is not None else None

    @property
    def has_calls(self) -> bool:
        """A call went out (the reply's finish reason is then "tool_calls")."""
        return self._calls is not None and self._calls.has_calls

    def feed(
        self, text: str, finished: bool, cut: bool = False
    ) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, call deltas) to send for the next delta of the reply's text
        (`finished`: the last one; `cut`: it ended at the token limit)."""
        reasoning, content = ("", text) if self._reasoning is None else self._reasoning.feed(text)
        if finished and self._reasoning is not None:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict[str, Any]] = []
        if self._calls is not None:
            content, calls = self._calls.feed(content)
            if finished:
                rest, more = self._calls.finish(cut)
                content, calls = content + (rest or ""), calls + more
        return reasoning, content, calls
