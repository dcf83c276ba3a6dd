"""Long prompts at the router: tokenized off the event loop, and refused from a prefix when that
alone fills the context (`router/request_prep.py`)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tandem.engine.tokenizer import Tokenizer
from tandem.router.errors import APIError
from tandem.router.request_prep import (
    INLINE_TEXT_CHARS,
    PREFIX_CHARS_PER_TOKEN,
    ModelLimits,
    prompt_token_ids,
    truncated,
)


class Recording:
    """The tokenizer, noting each text's length and the thread that tokenized it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[int, str]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((len(text), threading.current_thread().name))
        return self.tokenizer.encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Any) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_checkpoint())


def run(tok: Any, prompt: Any, max_model_len: int, truncating: bool = False) -> list[int]:
    return asyncio.run(prompt_token_ids(tok, prompt, ModelLimits(max_model_len, 10**6), truncating))


def test_short_prompts_are_tokenized_in_place(tokenizer: Tokenizer) -> None:
    tok = Recording(tokenizer)
    text = "short words " * 10
    assert run(tok, text, 4096) == tokenizer.encode(text)
    assert tok.calls == [(len(text), threading.current_thread().name)]
    assert run(tok, [5, 6, 7], 4096) == [5, 6, 7] and len(tok.calls) == 1


def test_a_long_prompt_is_tokenized_on_a_thread_of_its_own(tokenizer: Tokenizer) -> None:
    tok = Recording(tokenizer)
    text = "many words here " * (INLINE_TEXT_CHARS // 8)
    ids = run(tok, text, max_model_len=10**6)
    assert ids == tokenizer.encode(text)
    assert [(n, name.startswith("tokenize")) for n, name in tok.calls] == [(len(text), True)]


def test_a_prefix_that_fills_the_context_refuses_the_rest_untokenized(
    tokenizer: Tokenizer,
) -> None:
    tok = Recording(tokenizer)
    text = "a few words " * 200_000  # 2.4 M characters
    with pytest.raises(APIError) as caught:
        run(tok, text, max_model_len=1024)
    assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
    assert "the prompt has at least" in caught.value.message
    ((length, _),) = tok.calls
    assert length <= PREFIX_CHARS_PER_TOKEN * 1024  # only the prefix
    # Truncating keeps the prompt's end: the whole text is tokenized.
    tok.calls.clear()
    assert len(run(tok, text, max_model_len=1024, truncating=True)) > 1024
    assert [n for n, _ in tok.calls] == [len(text)]


class LongTokens:
    """A tokenizer whose every token covers 32 characters."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.lengths.append(len(text))
        return [7] * -(-len(text) // 32)


def test_a_long_prompt_whose_prefix_fits_goes_on() -> None:
    """Long tokens: the prefix does not fill the context, so the whole text is tokenized and
    judged by its own count (here it fits)."""
    tok = LongTokens()
    text = "x" * (PREFIX_CHARS_PER_TOKEN * 1024 + 8000)
    assert len(run(tok, text, max_model_len=1024)) == -(-len(text) // 32)
    assert tok.lengths == [PREFIX_CHARS_PER_TOKEN * 1024, len(text)]


def test_truncation_beyond_the_context_is_refused() -> None:
    """As vLLM: a `truncate_prompt_tokens` over max_model_len is a 400 naming it."""
    limits = ModelLimits(max_model_len=64, vocab_size=100)
    assert truncated(list(range(80)), 10, 8, limits) == list(range(70, 80))
    with pytest.raises(APIError) as refused:
        truncated(list(range(80)), 65, 8, limits)
    assert refused.value.status == 400 and refused.value.param == "truncate_prompt_tokens"
