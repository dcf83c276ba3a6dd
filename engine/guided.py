"""Structured output: JSON, or JSON that follows a schema, with xgrammar.

A request with `SamplingParams.json_schema` gets a grammar matcher (OpenAI's JSON mode is the
schema `{"type": "object"}`). Before each of its tokens is
sampled, the tokens the grammar does not allow at that point are masked out of its logits
(greedy and sampling alike, after penalties); the sampled token then advances the matcher. When
the grammar is complete only a stop token is allowed, and once the matcher accepts it the
request ends ("stop", also with `ignore_eos`). The logprobs a request gets back stay those of
the model's own logits.

Across a transfer the matcher is not sent: the decode engine builds its own and feeds it the
first token(s) the prefill sampled (`LLMEngine.attach_grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from tandem.engine.request import Request


def check_schema(schema: dict[str, Any]) -> None:
    """InvalidRequestError when xgrammar cannot turn `schema` into a grammar."""
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"unusable JSON schema: {_first_line(exc)}") from None


class GrammarBook:
    """One engine's grammars: its tokenizer's vocabulary as xgrammar sees it (built on first
    use) and the grammars compiled so far, by schema."""

    CACHE = 256

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._compiled: dict[str, Any] = {}

    def matcher(self, schema: dict[str, Any]) -> Any:
        """A fresh matcher for `schema` (InvalidRequestError for an unusable one)."""
        import xgrammar

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size
            )
            self._compiler = xgrammar.GrammarCompiler(info)
        key = json.dumps(schema, sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                # Compact JSON (`{"a": 1}`-style separators, no free whitespace): a model
                # that likes spaces cannot pad its answer until max_tokens.
                compiled = self._compiler.compile_json_schema(key, any_whitespace=False)
            except (RuntimeError, ValueError) as exc:
                raise InvalidRequestError(f"unusable JSON schema: {_first_line(exc)}") from None
            if len(self._compiled) >= self.CACHE:
                self._compiled.clear()
            self._compiled[key] = compiled
        return xgrammar.GrammarMatcher(compiled)


def mask_disallowed(logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int]) -> None:
    """Masks, in place, the tokens that the grammars of those of `rows` with a matcher do not
    allow next."""
    guided = [i for i in rows if requests[i].matcher is not None]
    if not guided:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(guided), logits.shape[-1])
    for j, i in enumerate(guided):
        requests[i].matcher.fill_next_token_bitmask(bitmask, j)
    for j, i in enumerate(guided):
        # (a copy: the model's logits may be vocabulary-major, and xgrammar writes rows in place)
        row = logits[i : i + 1].contiguous()
        xgrammar.apply_token_bitmask_inplace(row, bitmask[j : j + 1])
        logits[i] = row[0]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
