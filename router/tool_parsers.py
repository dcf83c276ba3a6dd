"""How a free reply's tool calls are written, per model family (`tool_choice` "auto").

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the reply,
  the text around the tags being the content (Qwen2.5, Qwen3, Hermes templates).
- `llama3_json`: the reply *is* the call(s): `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), several separated by `;`, optionally after `<|python_tag|>` (Llama 3.1-3.3).
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects, or (newer
  tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call; the text before it is the content.
  `[TOOL_CALLS]` is a special token, so the text must keep special tokens (`keeps_specials`).

`pick_tool_parser("auto", chat_template)` chooses by what the chat template teaches the model
(its call markers), falling back to `hermes`. A parser reads a finished reply (`parse`) and, for
streaming, says where in a reply so far a call begins (`call_start`) and how much of its end
must be held back because it may begin one (`undecided_tail`): the content before a call
streams as it comes (`call_stream.CallStream`), and each call streams too: its name once read
(`call_head`), then its arguments' JSON as it is written. A reply whose calls do not parse is
content.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

Calls = list[dict[str, Any]]


_NAME = r'"name"\s*:\s*("(?:[^"\\]|\\.)*")'  # (group: the name as a JSON string)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_entry(name: Any, arguments: Any) -> dict[str, Any] | None:
    """OpenAI's `tool_calls` entry (None unless `name` is a string and `arguments` an object
    or the JSON text of one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return call_record(name, json.dumps(arguments, ensure_ascii=False))  # (as vLLM writes them)


def call_record(name: str, arguments: str) -> dict[str, Any]:
    """A `tool_calls` entry with a new id, its arguments as the JSON text given."""
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _objects(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` is made of, back to back (whitespace and `separators` between
    them); None unless all of it parses."""
    decoder, at = json.JSONDecoder(), 0
    values: list[Any] = []
    skip = " \t\r\n" + separators
    while True:
        while at < len(text) and text[at] in skip:
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


class ToolParser(ABC):
    """Reads a model family's tool calls from its reply text."""

    name: ClassVar[str]
    keeps_specials: ClassVar[bool] = False
    """The call markers are special tokens: the reply's text must keep them."""

    call_head: ClassVar[re.Pattern[str] | None] = None
    """A call's start up to its arguments' value (searched from the first call on): group 1 is
    the name as a JSON string (or group 2, the bare name). None: calls come whole at the end."""

    max_calls: int | None = None
    """At most this many calls are read (OpenAI's `parallel_tool_calls: false`: 1); None: all."""

    def __call__(self, text: str) -> tuple[str | None, Calls]:
        content, calls = self.parse(text)
        if self.max_calls is None:
            return content, calls
        if not calls and (cut := self._start_of_call(text, self.max_calls)) is not None:
            # (a call past those read did not parse: the ones read, alone, as a stream sends
            # them; the rest was never going to be read. Those not parsing either: the reply)
            read = self.parse(text[:cut])
            content, calls = read if read[1] else (content, calls)
        return content, calls[: self.max_calls]

    def _start_of_call(self, text: str, index: int) -> int | None:
        """Where call `index` (0-based) begins in `text` (None: not so many begin)."""
        start = self.call_start(text)
        for _ in range(index):
            if start is None:
                return None
            after = self.call_start(text, start + 1)
            # (a format whose calls open the reply only gives its start again: one call)
            start = after if after is not None and after > start else None
        return start

    def at_most(self, max_calls: int) -> ToolParser:
        """This parser, reading at most `max_calls` calls (parsers keep no state: a copy)."""
        parser = copy.copy(self)
        parser.max_calls = max_calls
        return parser

    @staticmethod
    def head_name(match: re.Match[str]) -> str | None:
        """The function name a `call_head` match read (None: not a usable name)."""
        quoted, *bare = match.groups()
        if quoted is not None:
            try:
                name = json.loads(quoted)
            except ValueError:
                return None
        else:
            name = (bare[0] or "").strip() if bare else ""
        return name if isinstance(name, str) and name else None

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, Calls]:
        """(content, calls) of a finished reply; (text, []) when it holds no call that parses."""

    @abstractmethod
    def call_start(self, text: str, since: int = 0) -> int | None:
        """Where in the reply so far a call begins (None: none yet); none begins before
        `since` (that text went out as content: it was searched already)."""

    @abstractmethod
    def undecided_tail(self, text: str) -> int:
        """How many characters at the end of a reply so far with no call may still begin one."""


def tail_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerParser(ToolParser):
    """Calls after a marker anywhere in the reply (the text before it is content)."""

    marker: ClassVar[str]

    def call_start(self, text: str, since: int = 0) -> int | None:
        start = text.find(self.marker, since)
        return start if start >= 0 else None

    def undecided_tail(self, text: str) -> int:
        return tail_prefix_len(text, self.marker)


class HermesParser(MarkerParser):
    name = "hermes"
    marker = "<tool_call>"
    closing = "</tool_call>"
    call_head = re.compile(r"<tool_call>\s*\{\s*" + _NAME + r'\s*,\s*"arguments"\s*:\s*')

    def parse(self, text: str) -> tuple[str | None, Calls]:
        pieces, calls, rest = [], [], text
        while (start := rest.find(self.marker)) >= 0:
            pieces.append(rest[:start])
            body = rest[start + len(self.marker) :]
            end = body.find(self.closing)
            inside, rest = (body, "") if end < 0 else (body[:end], body[end + len(self.closing) :])
            rest = rest.lstrip()  # (as a stream, whose content after a call starts stripped)
            found = _objects(inside)
            if found is None or len(found) != 1 or not isinstance(found[0], dict):
                return text, []  # (the last may miss its closing tag: the model stopped)
            call = call_entry(found[0].get("name"), found[0].get("arguments"))
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        # (unstripped, as vLLM keeps the text before a call, and as it streams; whitespace
        # alone, e.g. a reasoning model's "\n\n" after its thoughts, is no content)
        content = "".join([*pieces, rest])
        return content if content.strip() else None, calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    call_head = re.compile(r"\{\s*" + _NAME + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*')

    def parse(self, text: str) -> tuple[str | None, Calls]:
        body = text.strip()
        body = body[len(self.tag) :] if body.startswith(self.tag) else body
        if not body.startswith("{"):
            return text, []
        found = _objects(body, ";")
        calls = []
        for value in found or [None]:
            if not isinstance(value, dict):
                return text, []
            arguments = value.get("parameters", value.get("arguments"))
            call = call_entry(value.get("name"), arguments)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls

    def call_start(self, text: str, since: int = 0) -> int | None:
        head = text.lstrip()  # (only the reply's start can open a call: `since` changes nothing)
        if head.startswith("{") or head.startswith(self.tag):
            return len(text) - len(head)
        return None

    def undecided_tail(self, text: str) -> int:
        head = text.lstrip()  # (a call can only open the reply)
        return len(text) if self.tag.startswith(head) else 0


class MistralParser(MarkerParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keeps_specials = True
    call_head = re.compile(
        r"\{\s*" + _NAME + r'\s*,\s*"arguments"\s*:\s*'
        r'|\[TOOL_CALLS\]\s*([^\[\]{}"\s]+)\s*\[ARGS\]\s*'
    )

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls: Calls = []
        for part in text[start:].split(self.marker)[1:]:
            made = self._calls(part)
            if made is None:
                return text, []
            calls += made
        content = text[:start]  # (unstripped, as vLLM's and as it streams)
        return content if content.strip() else None, calls

    @staticmethod
    def _calls(part: str) -> Calls | None:
        """The calls after one marker: `name[ARGS]{...}`, or a JSON list of calls."""
        if "[ARGS]" in part:
            name, _, arguments = part.partition("[ARGS]")
            found = _objects(arguments)
            if found is None or len(found) != 1:
                return None
            pairs = [(name.strip(), found[0])]
        else:
            found = _objects(part)
            listed = found[0] if found is not None and len(found) == 1 else None
            if not isinstance(listed, list) or not listed:
                return None
            if not all(isinstance(v, dict) for v in listed):
                return None
            pairs = [(v.get("name"), v.get("arguments")) for v in listed]
        made = [call_entry(name, arguments) for name, arguments in pairs]
        return None if any(c is None for c in made) else [c for c in made if c is not None]


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}
TOOL_CALL_PARSERS = ("auto", *PARSERS)


def pick_tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name`, or for "auto" the one whose call markers the chat template writes
    (hermes when it writes none of them)."""
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"unknown tool call parser {name!r}: one of {TOOL_CALL_PARSERS}")
        return PARSERS[name]()
    template = chat_template or ""
    if MistralParser.marker in template:
        return MistralParser()
    if HermesParser.marker not in template and (
        Llama3JsonParser.tag in template or "<|start_header_id|>" in template
    ):
        return Llama3JsonParser()
    return HermesParser()
