"""vLLM's small offline types, so that a script written for vLLM imports them from tandem:
`from tandem import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict


class RequestOutputKind(enum.IntEnum):
    """vLLM's `SamplingParams.output_kind`. `LLM.generate` returns finished outputs whatever
    it is (as vLLM's does)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """vLLM's `structured_outputs=` (`guided_decoding=` before 0.11): at most one of `json`
    (a schema, dict or text), `regex`, `choice`, `grammar` (xgrammar's EBNF), `json_object`.
    The `disable_*` switches and `whitespace_pattern` are accepted; the grammar never allows
    free whitespace and holds objects to their schema's properties."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's name before 0.11."""


class TextPrompt(TypedDict):
    """vLLM's text prompt dict."""

    prompt: str
    multi_modal_data: NotRequired[Any]


class TokensPrompt(TypedDict):
    """vLLM's token-id prompt dict."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Any]
