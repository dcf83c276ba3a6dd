"""Incremental detokenization: turn a stream of generated token ids into text deltas.

Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character; decoding such a
prefix yields U+FFFD. `IncrementalDetokenizer` never emits that partial character: it holds text
back while the decode of its window ends in U+FFFD, and emits it once the character completes (or
at `flush`, when the request ends).

How it works: the detokenizer keeps a short *window* of token ids and the text of the window's
first ``read`` tokens (``prefix_text``). Each step appends the new ids, decodes the window once
and emits what the decode has beyond ``prefix_text``. The window starts with a few prompt tokens,
so that tokenizers whose decode depends on context (e.g. strip a leading space at the start of a
sequence) render the first output token as it reads after the prompt. Whenever the window grows
past ``MAX_WINDOW`` tokens at a clean point (its decode not ending in U+FFFD), it is cut down to its
last ``CONTEXT_TOKENS`` tokens, so the cost of a step is O(window), not O(output length).

Contract: for a tokenizer whose decode of a concatenation is the concatenation of decodes at
character boundaries (byte-level BPE, like every checkpoint `build_tiny_checkpoint` writes), the
deltas of all steps plus `flush` concatenate to exactly
``tokenizer.decode(output_ids, skip_special_tokens=...)``. If the prompt's tail is an incomplete
character (which the output might complete), the prompt is not used as context, so the output's
leading bytes decode as they do on their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

CONTEXT_TOKENS = 5
"""Tokens of context kept at the start of the window (taken from the prompt at first)."""

MAX_WINDOW = 16
"""The window is cut back to CONTEXT_TOKENS tokens when it grows past this many."""


class IncrementalDetokenizer:
    """Per-request streaming detokenizer; not thread-safe (one request, one owner)."""

    __slots__ = ("_tokenizer", "_skip", "_window", "_read", "_prefix_text", "_pieces", "_text")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        window = list(prompt_token_ids[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS > 0 else []
        prefix_text = tokenizer.decode(window, skip_special_tokens) if window else ""
        if prefix_text.endswith(REPLACEMENT_CHAR):
            window, prefix_text = [], ""
        self._window: list[int] = window
        self._read = len(window)  # window[:read] have been turned into text (prefix_text)
        self._prefix_text = prefix_text
        self._pieces: list[str] = []
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every returned delta)."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    @property
    def pending_token_count(self) -> int:
        """Output tokens whose text is still held back (0 once everything has been emitted)."""
        return len(self._window) - self._read

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they finalize (possibly "")."""
        if not new_token_ids:
            return ""
        window = self._window
        window.extend(new_token_ids)
        full = self._tokenizer.decode(window, self._skip)
        if full.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character at the end: wait for its remaining bytes
        return self._emit(full)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self._read == len(self._window):
            return ""
        return self._emit(self._tokenizer.decode(self._window, self._skip))

    def _emit(self, full: str) -> str:
        """Emit ``full`` (the decode of the whole window) beyond ``prefix_text``; move the window."""
        prefix_len = len(self._prefix_text)
        delta = full[prefix_len:] if len(full) > prefix_len else ""
        window = self._window
        if len(window) > MAX_WINDOW:
            # Cut at a clean point: the kept tail's decode is a prefix of every later decode.
            del window[:-CONTEXT_TOKENS]
            self._prefix_text = self._tokenizer.decode(window, self._skip)
        else:
            self._prefix_text = full
        self._read = len(window)
        if delta:
            self._pieces.append(delta)
        return delta

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(emitted_chars={len(self.text)}, "
            f"pending_tokens={self.pending_token_count})"
        )
