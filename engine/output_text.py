"""A request's output text as it grows token by token (for stop strings and streaming)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.tokenizer import Tokenizer


class OutputText:
    """Finalized text so far, plus how much of it was searched for stops and streamed."""

    __slots__ = ("detokenizer", "text", "checked_len", "emitted_len")

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.text = ""
        self.checked_len = 0
        self.emitted_len = 0

    @classmethod
    def after(
        cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], token_ids: Sequence[int] = ()
    ) -> OutputText:
        """The text of `token_ids` generated after the prompt (nothing streamed yet)."""
        text = cls(IncrementalDetokenizer(tokenizer, prompt_token_ids))
        for token in token_ids:
            text.add(token)
        return text

    def add(self, token_id: int) -> None:
        self.text += self.detokenizer.step([token_id])

    def flush(self) -> None:
        self.text += self.detokenizer.flush()

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]
        self.emitted_len = min(self.emitted_len, length)
