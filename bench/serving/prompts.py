"""Prompt material of exact (token ids) or approximate (words) length.

With the served model's tokenizer, prompts are lists of token ids drawn from its ordinary
vocabulary, so their lengths are exact and nothing is lost to re-tokenizing (the completions API
takes token ids). Without one, prompts are text of random common words, as many as make the
length asked for at the rate the server's tokenizer counts them (its `/tokenize`; one token a
word where the server has none).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

Prompt = str | list[int]

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "this",
    "it",
    "be",
    "are",
    "or",
    "an",
    "was",
    "which",
    "model",
    "token",
    "cache",
    "block",
    "prefill",
    "decode",
    "stream",
    "request",
    "batch",
    "worker",
    "router",
    "queue",
    "page",
    "time",
    "first",
    "output",
    "input",
    "length",
    "rate",
    "load",
    "serve",
    "cluster",
    "memory",
    "layer",
    "head",
    "value",
    "key",
]


class PromptMaker(ABC):
    """Makes prompt pieces and joins them; `length` is the piece's size in tokens (or words)."""

    @abstractmethod
    def random(self, rng: random.Random, length: int) -> Prompt: ...

    @abstractmethod
    def join(self, *parts: Prompt) -> Prompt: ...

    @abstractmethod
    def from_text(self, text: str) -> Prompt:
        """A server's generated text as prompt material (a conversation's history)."""

    @abstractmethod
    def length(self, prompt: Prompt) -> int: ...


class TokenPrompts(PromptMaker):
    """Token ids from a tokenizer's vocabulary, special tokens excluded."""

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: tandem's `Tokenizer` or a Hugging Face tokenizer."""
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "hf", tokenizer)
        vocab = int(getattr(tokenizer, "vocab_size", 0) or len(hf))
        special = set(getattr(hf, "all_special_ids", []) or [])
        self.ids = [i for i in range(vocab) if i not in special]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TokenPrompts:
        from tandem.engine.tokenizer import Tokenizer

        return cls(Tokenizer.from_pretrained(path))

    def random(self, rng: random.Random, length: int) -> Prompt:
        return [self.ids[rng.randrange(len(self.ids))] for _ in range(length)]

    def join(self, *parts: Prompt) -> Prompt:
        out: list[int] = []
        for part in parts:
            out.extend(self._encode(part) if isinstance(part, str) else part)
        return out

    def from_text(self, text: str) -> Prompt:
        return self._encode(text)

    def length(self, prompt: Prompt) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self._encode(prompt))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class WordPrompts(PromptMaker):
    """Text of random common words; a length is a number of tokens at `tokens_per_word` (what
    the server's tokenizer makes of these words, `calibrated`; 1 when it is not known)."""

    def __init__(self, tokens_per_word: float = 1.0) -> None:
        self.tokens_per_word = max(float(tokens_per_word), 1e-3)

    @classmethod
    def calibrated(cls, count_tokens: Callable[[str], int], seed: int = 0) -> WordPrompts:
        """Word prompts whose lengths are tokens as `count_tokens` (the server's tokenizer)
        counts them, from a sample of 1,000 words."""
        sample = cls().random(random.Random(seed), 1000)
        assert isinstance(sample, str)
        return cls(count_tokens(sample) / 1000)

    def random(self, rng: random.Random, length: int) -> Prompt:
        words = max(1, round(length / self.tokens_per_word))
        return " ".join(rng.choice(WORDS) for _ in range(words))

    def join(self, *parts: Prompt) -> Prompt:
        return " ".join(p.strip() for p in parts if isinstance(p, str) and p.strip())

    def from_text(self, text: str) -> Prompt:
        return text

    def length(self, prompt: Prompt) -> int:
        if not isinstance(prompt, str):
            return len(prompt)
        return round(len(prompt.split()) * self.tokens_per_word)
