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
last ``CONTEXT_TOKENS`` tokens (more where those would begin inside a character), so the cost of a
step is O(window), not O(output length).

SentencePiece's byte fallback (Llama 2, Mistral v0.x) decodes a run of byte tokens (`<0xF0>`)
as one: a valid run is its UTF-8 text, an invalid one a U+FFFD per byte, so a run's text is
held until a token that is not a byte token ends it (or `flush`).

Contract: for a tokenizer whose decode of a concatenation is the concatenation of decodes at
character boundaries (byte-level BPE, like every checkpoint `build_tiny_checkpoint` writes; byte
fallback at the ends of runs), the deltas of all steps plus `flush` concatenate to exactly
``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up=False)``: the tokenizer's
`clean_up_tokenization_spaces` is never applied (it rewrites text already emitted; vLLM's
detokenizer does not apply it either). If the prompt's tail is an incomplete
character (which the output might complete), the prompt is not used as context, so the output's
leading bytes decode as they do on their own; a prompt that ends in a run of byte tokens is
used as context up to that run.
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

    __slots__ = (
        "_tokenizer", "_skip", "_byte_runs", "_skipped", "_window", "_read", "_prefix_text",
        "_pieces", "_text", "_bare", "_last_added",
    )  # fmt: skip

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Special tokens kept and no spaces between them (vLLM's rule): an added token right
        # after another is written as its bare text, without the space a decoder may put
        # before it. None: every token as the tokenizer decodes it.
        bare = not (skip_special_tokens or spaces_between_special_tokens)
        self._bare = (tokenizer.added_token_texts or None) if bare else None
        self._last_added = False
        self._byte_runs = tokenizer.byte_run_ids
        # (skipped special tokens vanish before the byte tokens around them are decoded:
        # a run goes on across them)
        self._skipped = tokenizer.special_ids if skip_special_tokens and self._byte_runs else ()
        # The context ends before a run of byte tokens at the prompt's end (the output's first
        # bytes would join that run), not at the start: "hello\n" keeps "hello" as context.
        end = self._run_start(prompt_token_ids) if self._byte_runs else len(prompt_token_ids)
        window = list(prompt_token_ids[max(0, end - CONTEXT_TOKENS) : end])
        prefix_text = tokenizer.decode(window, skip_special_tokens, False) if window else ""
        if prefix_text.endswith(REPLACEMENT_CHAR):
            window, prefix_text = [], ""  # (the output's first bytes would join the prompt's)
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
        if self._bare is None:
            return self._step(new_token_ids)
        out, start = "", 0
        for i, token in enumerate(new_token_ids):
            added = token in self._bare
            if added and self._last_added:  # its bare text; the window starts over at it
                out += self._step(new_token_ids[start:i]) + self.flush()
                text = self._bare[token]
                self._pieces.append(text)
                self._window = [token]
                self._read = 1
                self._prefix_text = self._tokenizer.decode([token], self._skip, False)
                out += text
                start = i + 1
            self._last_added = added
        return out + self._step(new_token_ids[start:])

    def _step(self, new_token_ids: Sequence[int]) -> str:
        if not new_token_ids:
            return ""
        window = self._window
        window.extend(new_token_ids)
        if self._byte_runs and self._in_byte_run():
            return ""  # a run of byte-fallback tokens goes on: its text is known at its end
        full = self._tokenizer.decode(window, self._skip, False)
        if full.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character at the end: wait for its remaining bytes
        return self._emit(full)

    def peek(self) -> str:
        """The text of the tokens held back as it reads if the output ends now, when that
        is whole characters (a run of byte tokens that is valid UTF-8 so far), else "".
        Stop strings are searched in it: a request that stops there ends the run."""
        if self._read == len(self._window):
            return ""
        full = self._tokenizer.decode(self._window, self._skip, False)
        if full.endswith(REPLACEMENT_CHAR):
            return ""
        return full[len(self._prefix_text) :]

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self._read == len(self._window):
            return ""
        return self._emit(self._tokenizer.decode(self._window, self._skip, False))

    def _emit(self, full: str) -> str:
        """Emit ``full`` (the decode of the whole window) beyond ``prefix_text``; move the window."""
        prefix_len = len(self._prefix_text)
        delta = full[prefix_len:] if len(full) > prefix_len else ""
        window = self._window
        cut = self._clean_cut(full) if len(window) > MAX_WINDOW else None
        if cut is not None:
            del window[: cut[0]]
            self._prefix_text = cut[1]
        else:
            self._prefix_text = full
        self._read = len(window)
        if delta:
            self._pieces.append(delta)
        return delta

    def _run_start(self, token_ids: Sequence[int]) -> int:
        """Where the run of byte tokens that `token_ids` end in starts (skipped special
        tokens within it aside); len(token_ids) if they end in none."""
        end = len(token_ids)
        for i in range(len(token_ids) - 1, -1, -1):
            token = token_ids[i]
            if token in self._byte_runs:
                end = i
            elif token not in self._skipped:
                break
        return end

    def _in_byte_run(self) -> bool:
        """Whether the window ends in a byte-fallback token (skipped special tokens aside)."""
        for token in reversed(self._window):
            if token not in self._skipped:
                return token in self._byte_runs
        return False

    def _clean_cut(self, full: str) -> tuple[int, str] | None:
        """Where the window (whose decode is `full`, ending on a whole character) may start
        over, and the text it then starts with: its last CONTEXT_TOKENS or more tokens, from
        the first such tail that decodes to the end of `full` and does not begin inside a
        character. (SentencePiece's byte fallback decodes a run of byte tokens as one: a tail
        that began inside an emoji's bytes would turn the rest of the run into U+FFFDs.)
        None: no such tail now (the window grows and is tried again next time)."""
        window = self._window
        for keep in range(CONTEXT_TOKENS, len(window)):
            text = self._tokenizer.decode(window[-keep:], self._skip, False)
            if full.endswith(text) and not text.startswith(REPLACEMENT_CHAR):
                return len(window) - keep, text
        return None

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(emitted_chars={len(self.text)}, "
            f"pending_tokens={self.pending_token_count})"
        )
