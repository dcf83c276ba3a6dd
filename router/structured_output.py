"""Which structured output an OpenAI-style request asks for, from whichever field it uses.

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's extensions: the
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`) and the older
top-level `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. Each becomes one
of the engine's `SamplingParams.structure` kinds. A request may use one of them; two are a 400
naming both, and a schema, regular expression or grammar xgrammar cannot use is a 400 naming the
field it came in.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.errors import InvalidRequestError
from tandem.engine.guided import check_structure
from tandem.router.errors import bad_request

Structure = tuple[str, Any]
"""(kind, value) as `SamplingParams.structure` has it: json_schema, regex, choice, grammar."""


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field (set one of them)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


STRUCTURED_OUTPUT_OPTIONS = frozenset(
    {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}
)
"""vLLM's `structured_outputs` options that change nothing here: JSON is always written without
free whitespace, with no properties the schema does not name, by the one grammar backend."""


def from_response_format(fmt: dict[str, Any] | None) -> Structure | None:
    """OpenAI's `response_format`: None for text (or no format)."""
    fmt = fmt or {}
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    if kind != "json_schema":
        raise bad_request(
            f"response_format {kind!r} is not supported (text, json_object, json_schema)",
            "response_format",
            "unsupported",
        )
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format json_schema needs json_schema.schema (an object)", "response_format"
        )
    return "json_schema", schema


def from_structured_outputs(spec: StructuredOutputs) -> list[tuple[str, Structure]]:
    """vLLM's `structured_outputs`: (field, structure) for each member set."""
    field = "structured_outputs"
    extra = (spec.model_extra or {}).items()
    unknown = sorted(k for k, v in extra if v is not None and k not in STRUCTURED_OUTPUT_OPTIONS)
    if unknown:
        raise bad_request(
            f"{field}.{unknown[0]} is not supported (json, regex, choice, grammar, json_object)",
            f"{field}.{unknown[0]}",
            "unsupported",
        )
    found: list[tuple[str, Structure]] = []
    if spec.json_ is not None:
        found.append((f"{field}.json", ("json_schema", parse_schema(spec.json_, f"{field}.json"))))
    if spec.json_object:
        found.append((f"{field}.json_object", ("json_schema", {"type": "object"})))
    for kind in ("regex", "choice", "grammar"):
        if (value := getattr(spec, kind)) is not None:
            found.append((f"{field}.{kind}", (kind, value)))
    return found


def from_guided_fields(fields: dict[str, Any]) -> list[tuple[str, Structure]]:
    """vLLM's older top-level `guided_*` fields, as given (unset ones None)."""
    found: list[tuple[str, Structure]] = []
    if (value := fields.get("guided_json")) is not None:
        found.append(("guided_json", ("json_schema", parse_schema(value, "guided_json"))))
    for kind in ("regex", "choice", "grammar"):
        if (value := fields.get(f"guided_{kind}")) is not None:
            found.append((f"guided_{kind}", (kind, value)))
    return found


def one_structure(found: list[tuple[str, Structure]]) -> Structure | None:
    """The one structure asked for, checked (400 for two, or for one xgrammar cannot use)."""
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        raise bad_request(f"only one field may constrain the output, got {names}", found[1][0])
    field, structure = found[0]
    _check_value(field, structure)
    try:
        check_structure(structure, strict=field != "tools")
    except InvalidRequestError as exc:
        raise bad_request(str(exc), field) from None
    return structure


def _check_value(field: str, structure: Structure) -> None:
    kind, value = structure
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise bad_request(f"{field} must be a non-empty list of strings", field)
        if not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{field} must hold non-empty strings", field)
    elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise bad_request(f"{field} must be a non-empty string", field)


def parse_schema(value: Any, field: str) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"{field} is not JSON", field) from None
        except RecursionError:
            raise bad_request(f"{field} is nested too deeply", field) from None
    if not isinstance(value, dict):
        raise bad_request(f"{field} must be a JSON schema (an object)", field)
    return value
