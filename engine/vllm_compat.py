"""vLLM's small offline types, so that a script written for vLLM imports them from tandem:
`from tandem import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt`."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from tandem.engine.errors import InvalidRequestError


class RequestOutputKind(enum.IntEnum):
    """vLLM's `SamplingParams.output_kind`. `LLM.generate` returns finished outputs whatever
    it is (as vLLM's does)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """vLLM's `SamplingParams.sampling_type`."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


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

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]  # fmt: skip
        if len(given) > 1:
            raise InvalidRequestError(
                f"structured outputs take one constraint, got {', '.join(given)}"
            )


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


_VLLM_STRUCTURE = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def structure_fields(name: str, spec: object) -> dict[str, object]:
    """vLLM's `structured_outputs=` / `guided_decoding=` (a dict or an object with `json`,
    `regex`, `choice`, `grammar`, `json_object`) as `SamplingParams` fields."""
    if spec is None:
        return {}
    get = spec.get if isinstance(spec, dict) else lambda key: getattr(spec, key, None)
    fields: dict[str, object] = {}
    for key, field in _VLLM_STRUCTURE.items():
        value = get(key)
        if value is not None:
            if key == "json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise InvalidRequestError(f"{name}.json is not JSON") from None
            fields[field] = value
    if get("json_object"):
        if fields:
            raise InvalidRequestError(
                f"{name} sets json_object and {', '.join(sorted(fields))}: one constraint only"
            )
        fields["json_schema"] = {"type": "object"}
    if not fields:
        raise InvalidRequestError(f"{name} sets none of json, regex, choice, grammar, json_object")
    return fields
