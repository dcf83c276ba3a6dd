"""One streamed free reply with tools ("auto"): its content as it comes, then each call as the
model writes it, in OpenAI's streaming shape.

A call's first delta carries its index, id, type and name (`{"index": k, "id": ..., "type":
"function", "function": {"name": ..., "arguments": ""}}`), the next ones pieces of its
arguments (`{"index": k, "function": {"arguments": "..."}}`); a client joins the pieces of an
index. The arguments stream as the model writes their JSON object (its own spacing); a call
whose head the parser cannot read early (`ToolParser.call_head`: e.g. its arguments come before
its name), or whose arguments are not an object, comes whole when the reply ends. What went out
is checked against the whole reply's parse at the end; a reply whose calls do not parse after
all ends, once a call's deltas went out (they cannot be taken back), with those pieces, as
vLLM streams it: finish "tool_calls", or "length" when the token limit cut it short (its text is
not sent again as content; the body, read whole, has the text as content and no call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.router.tool_parsers import ToolParser, new_call_id

Delta = dict[str, Any]


@dataclass
class _Call:
    """One call seen in the reply: where its arguments' JSON is, and how much went out."""

    index: int
    at: int  # where the scan goes on (the arguments start at or after the head's end)
    start: int | None = None  # where the arguments' value starts (None: not written yet)
    end: int | None = None  # just past it, once complete
    sent: int = 0  # how far its text went out (an object's)
    is_object: bool = False  # streams as it is written (else: whole at the end)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> None:
        """Goes on over `text` (the reply so far), until the value is complete."""
        i = self.at
        if self.start is None:
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i < len(text):
                self.start = self.sent = i
                self.is_object = text[i] == "{"
        while self.start is not None and i < len(text) and self.end is None:
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    self.end = i + 1 if self.depth == 0 else None  # (a string value ends)
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]" or self.depth == 0:  # (a bare value: its end is left to `parse`)
                self.depth -= 1
                self.end = i + 1 if self.depth <= 0 else None
            i += 1
        self.at = i


class CallStream:
    """`feed` gives the content that can go out now (holding back a tail that may begin a call)
    and the call deltas; `finish` the rest of the content and the last deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""  # the reply so far
        self._sent = 0  # how much of it went out as content
        self._call: int | None = None  # where the first call begins, once seen
        self._calls: list[_Call] = []
        self.has_calls = False  # a call delta went out

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        self._text += text
        if self._call is None:
            self._call = self._parser.call_start(self._text, self._sent)
        if self._call is not None:
            end = self._call
        else:
            end = len(self._text) - self._parser.undecided_tail(self._text)
        end = max(end, self._sent)
        out = self._text[self._sent : end]
        if self._sent == 0 and not out.strip():  # (leading whitespace waits: before a call,
            return "", self._advance()  # the body strips it; before text, it goes with it)
        self._sent = end
        return out, self._advance()

    def finish(self, cut: bool = False) -> tuple[str | None, list[Delta]]:
        """The rest of the content and the last deltas; `cut`: the reply ended at its token
        limit (a call cut short, whose deltas went out, is not sent again as content)."""
        held, self._sent = self._text[self._sent :], len(self._text)
        if self._call is None:
            return held or None, []
        deltas = self._advance()
        content, calls = self._parser(held)
        if not calls:
            if not self.has_calls:  # (the reply's text is its content: no call went out)
                return held or None, _merged(deltas)
            # Call deltas went out and cannot be taken back: as vLLM streams it, the reply
            # ends with them, its text not sent again as content; finish "tool_calls", or
            # "length" where it was `cut` (`has_calls` False).
            self.has_calls = not cut
            return None, _merged(deltas)
        for k, call in enumerate(calls):
            seen = self._calls[k] if k < len(self._calls) else None
            if seen is None:
                deltas.append({"index": k, **call})
            elif not seen.is_object:  # (its arguments were not an object: they go whole now)
                deltas.append(
                    {"index": k, "function": {"arguments": call["function"]["arguments"]}}
                )
        self.has_calls = True
        return content, _merged(deltas)

    def _advance(self) -> list[Delta]:
        """The deltas of what the reply so far adds to its calls."""
        head = self._parser.call_head
        if self._call is None or head is None:
            return []
        deltas: list[Delta] = []
        text = self._text
        while True:
            if self._calls and self._calls[-1].end is None:
                call = self._calls[-1]
                call.scan(text)
                if call.is_object and (call.end or len(text)) > call.sent:
                    piece = text[call.sent : call.end or len(text)]
                    deltas.append({"index": call.index, "function": {"arguments": piece}})
                    call.sent = call.end or len(text)
                if call.end is None:
                    break
            if len(self._calls) == self._parser.max_calls:
                break  # (the rest is not read)
            since = self._calls[-1].end if self._calls else self._call
            match = head.search(text, since or 0)
            name = self._parser.head_name(match) if match is not None else None
            if match is None or name is None:
                break
            self._calls.append(_Call(len(self._calls), match.end()))
            deltas.append(
                {
                    "index": len(self._calls) - 1,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
        if deltas:
            self.has_calls = True
        return _merged(deltas)


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Consecutive deltas of one call as one (their argument pieces joined)."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if (
            last is not None
            and last["index"] == delta["index"]
            and set(delta) == {"index", "function"}
        ):
            merged = dict(last["function"])
            merged["arguments"] = merged.get("arguments", "") + delta["function"]["arguments"]
            out[-1] = {**last, "function": merged}
        else:
            out.append(delta)
    return out
