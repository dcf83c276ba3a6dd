"""Structured output with xgrammar: JSON (following a schema), a regular expression, a choice
of strings, or an EBNF grammar.

A request whose `SamplingParams.structure` is set (one of `json_schema`, `regex`, `choice`,
`grammar`; OpenAI's JSON mode is the schema `{"type": "object"}`) gets a grammar matcher. Before
each of its tokens is sampled, the tokens the grammar does not allow at that point are masked
out of its logits (greedy and sampling alike, after penalties); the sampled token then advances
the matcher. When the grammar is complete only a stop token is allowed, and once the matcher
accepts it the request ends ("stop", also with `ignore_eos`). The logprobs a request gets back
stay those of the model's own logits.

With `reasoning_tags` (set by the router when it has a reasoning parser), the structure
constrains only the answer after the model's thoughts (`reasoning_gate.py`).

Across a transfer the matcher is not sent: the decode engine builds its own and feeds it the
first token(s) the prefill sampled (`LLMEngine.attach_constraints`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from tandem.engine.errors import InvalidRequestError
from tandem.engine.json_schema_support import unenforced
from tandem.engine.reasoning_gate import ReasoningGate
from tandem.engine.request import request_stop_ids

if TYPE_CHECKING:
    import torch

    from tandem.engine.request import Request
    from tandem.engine.sampling_params import SamplingParams


def check_schema(schema: dict[str, Any]) -> None:
    """InvalidRequestError when xgrammar cannot turn `schema` into a grammar."""
    check_structure(("json_schema", schema))


def check_enforceable(structure: tuple[str, Any] | None) -> None:
    """InvalidRequestError when `structure` is a JSON schema some of which the grammar would
    not enforce (`json_schema_support`): the output could break it."""
    problem = None
    if structure is not None and structure[0] == "json_schema":
        problem = unenforced(structure[1])
    if problem is not None:
        raise InvalidRequestError(f"unusable JSON schema: the grammar cannot enforce {problem}")


def check_structure(structure: tuple[str, Any], strict: bool = True) -> None:
    """InvalidRequestError when xgrammar cannot turn `structure` (`SamplingParams.structure`)
    into a grammar: a bad schema, regular expression or EBNF text; `strict`, also a schema
    some of which it would not enforce (a tool's parameters are not held to that: a call
    whose arguments break a keyword of them beats no call)."""
    if strict:
        check_enforceable(structure)
    try:
        kind, text = _key(structure)
    except RecursionError:  # (a schema nested deeper than Python's stack: no grammar either)
        raise InvalidRequestError(f"unusable {_NAMES[structure[0]]}: nested too deeply") from None
    if (problem := _grammar_problem(kind, text)) is not None:
        raise InvalidRequestError(f"unusable {_NAMES[kind]}: {problem}")


@functools.lru_cache(maxsize=256)
def _grammar_problem(kind: str, text: str) -> str | None:
    """Why xgrammar cannot turn the text of a structure into a grammar (None: it can). Kept
    per text: clients send the same schema again and again, and a large one takes seconds."""
    import xgrammar

    try:
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(text)
        else:
            xgrammar.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        return _first_line(exc)
    return None


_NAMES = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "grammar",
}


def _ebnf(kind: str, value: Any) -> str:
    """EBNF text of a `choice` (its strings as alternatives) or a `grammar`."""
    if kind == "choice":  # (JSON string literals are EBNF ones, escapes included)
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    return str(value)


def _key(structure: tuple[str, Any]) -> tuple[str, str]:
    """A structure's kind and text (a schema's keys in its own order: the output's properties
    come in it)."""
    kind, value = structure
    return kind, json.dumps(value) if kind == "json_schema" else _ebnf(kind, value)


async def compile_ahead(book: GrammarBook, params: SamplingParams) -> None:
    """Compiles the grammar of a request with structured output into `book` on a thread of
    its own, so that the engine's thread finds it compiled. An unusable grammar is left for
    the engine to refuse (as it would without this)."""
    structure = params.structure
    if structure is None or book.is_compiled(structure):
        return
    with contextlib.suppress(InvalidRequestError):
        await asyncio.to_thread(book.compiled, structure)


class GrammarBook:
    """One engine's grammars: its tokenizer's vocabulary as xgrammar sees it (built on first
    use) and the grammars compiled so far, by kind and text. Thread-safe: workers compile a
    request's grammar on another thread (`compile_ahead`) before the engine's thread needs it
    (with a large vocabulary a schema takes up to seconds, and every request would wait)."""

    CACHE = 256

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int] = ()
    ) -> None:
        """`eos_token_ids`: every token that ends a request (the tokenizer's EOS and the model's
        others, generation_config.json's)."""
        self._tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = frozenset(eos_token_ids)
        self._compiler: Any = None
        self._compiled: dict[tuple[str, str], Any] = {}
        self._tag_cache: dict[str, list[int]] = {}
        self._lock = threading.Lock()  # (the compiler's creation, and the cache's writes)

    def matcher(self, structure: tuple[str, Any], stop_token_ids: Collection[int] = ()) -> Any:
        """A fresh matcher for `structure` (`SamplingParams.structure`; InvalidRequestError
        for an unusable one) that ends on `stop_token_ids` (none: the tokenizer's EOS) and
        allows none of them before the structure is complete."""
        import xgrammar

        stops = sorted(stop_token_ids) or None
        return xgrammar.GrammarMatcher(self.compiled(structure), override_stop_tokens=stops)

    def compiled(self, structure: tuple[str, Any]) -> Any:
        """`structure`'s compiled grammar, from the cache or compiled now (InvalidRequestError
        for an unusable one)."""
        key = _key(structure)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        try:
            compiled = self._compile(*key)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequestError(f"unusable {_NAMES[key[0]]}: {_first_line(exc)}") from None
        with self._lock:
            while len(self._compiled) >= self.CACHE:  # (the oldest goes)
                del self._compiled[next(iter(self._compiled))]
            self._compiled[key] = compiled
        return compiled

    def is_compiled(self, structure: tuple[str, Any]) -> bool:
        return _key(structure) in self._compiled

    def matcher_for(self, params: SamplingParams, prompt_token_ids: Sequence[int]) -> Any:
        """The matcher of a request with structured output: with `reasoning_tags`, behind a
        `ReasoningGate` that lets the model think first (the prompt tells where it starts)."""
        structure = params.structure
        assert structure is not None, "only for requests with structured output"
        matcher = self.matcher(structure, self._stop_token_ids(params))
        if params.reasoning_tags is None:
            return matcher
        open_ids, close_ids = (self._tag_ids(tag) for tag in params.reasoning_tags)
        return ReasoningGate(matcher, open_ids, close_ids, prompt_token_ids)

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end the request (as the engine stops on them: any of them inside
        the structure would cut it short) and the tokenizer's EOS (the grammar's own end)."""
        eos = getattr(self._tokenizer, "eos_token_id", None)
        own = frozenset({int(eos)}) if eos is not None else frozenset()
        return request_stop_ids(params, self._eos_token_ids) | own

    def _tag_ids(self, tag: str) -> list[int]:
        ids = self._tag_cache.get(tag)
        if ids is None:
            ids = self._tag_cache[tag] = list(self._tokenizer.encode(tag, add_special_tokens=False))
        return ids

    def _compile(self, kind: str, text: str) -> Any:
        import xgrammar

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size
                )
                self._compiler = xgrammar.GrammarCompiler(info)
        if kind == "json_schema":
            # `{"a": 1}`-style separators and no free whitespace: a model that likes spaces
            # cannot pad its answer until max_tokens.
            grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
            return self._compiler.compile_grammar(without_raw_control_characters(str(grammar)))
        if kind == "regex":
            return self._compiler.compile_regex(text)
        return self._compiler.compile_grammar(text)


LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
"""How xgrammar (0.2.9) writes a character of a string with a length bound (`maxLength`,
`minLength`): it lets control characters through, which JSON does not allow raw."""
STRICT_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def without_raw_control_characters(ebnf: str) -> str:
    """A JSON schema's EBNF (xgrammar's text) whose every string character excludes U+0000 -
    U+001F, as its unbounded strings already do: the output stays valid JSON."""
    return ebnf.replace(LOOSE_STRING_CHARACTER, STRICT_STRING_CHARACTER)


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


_SOURCE_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?[\w./-]+\.(cc|cpp|h|py):\d+:\s*")
"""xgrammar's C++ log prefix (``[00:19:51] /project/cpp/regex_converter.cc:94: ``)."""


def _first_line(exc: BaseException) -> str:
    """The last line of the library's message, without its source-file prefix."""
    text = str(exc).strip().splitlines()
    return _SOURCE_PREFIX.sub("", text[-1]) if text else type(exc).__name__
