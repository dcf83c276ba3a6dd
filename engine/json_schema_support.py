"""What of a JSON schema the structured-output grammar cannot enforce.

xgrammar turns a schema into a grammar and drops, with no more than a log line, the keywords it
cannot express: the output would then break the schema while the request ends "stop" as if it
held. Such a schema is refused instead (a 400 naming the keyword and where it is), as vLLM's
xgrammar backend refuses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

UNENFORCED_KEYWORDS = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "patternProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
"""Keywords that constrain the output but that the grammar leaves out wherever they are."""

STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
"""The string formats the grammar writes out."""

ANNOTATIONS = frozenset(
    {"$ref", "title", "description", "default", "examples", "$comment", "deprecated",
     "readOnly", "writeOnly", "$defs", "definitions", "$schema", "$id"}
)  # fmt: skip
"""Keywords beside a `$ref` that constrain nothing there (any other one is left out)."""


def unenforced(schema: Any) -> str | None:
    """The first part of `schema` the grammar would not enforce, said with where it is; None
    when the grammar holds the output to all of it."""
    return next(_problems(schema, "the schema"), None)


def _problems(schema: Any, where: str) -> Iterator[str]:
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            yield f"{keyword!r} (in {where})"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield f"'allOf' of more than one schema (in {where})"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"the external $ref {ref!r} (in {where})"
    if ref is not None and (extra := sorted(set(schema) - ANNOTATIONS)):
        yield f"{', '.join(map(repr, extra))} beside a $ref (in {where})"
    yield from _string_problems(schema, where)
    if "multipleOf" in schema and schema.get("type") != "integer":
        yield f"'multipleOf' on a non-integer (in {where})"
    properties, required = schema.get("properties"), schema.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        missing = [name for name in required if name not in properties]
        if missing:
            yield f"required {missing} not among the properties (in {where})"
    for name, sub in _subschemas(schema):
        yield from _problems(sub, f"{where} > {name}")


def _string_problems(schema: dict[str, Any], where: str) -> Iterator[str]:
    bounded = "minLength" in schema or "maxLength" in schema
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in STRING_FORMATS:
        yield f"the string format {fmt!r} (in {where}; known: {', '.join(sorted(STRING_FORMATS))})"
    for keyword in ("pattern", "format"):
        if keyword in schema and bounded:
            yield f"{keyword!r} with minLength/maxLength (in {where})"


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for keyword in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(keyword) or {}).items():
            yield f"{keyword}.{name}", sub
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            yield keyword, schema[keyword]
    for keyword in ("prefixItems", "anyOf", "oneOf", "allOf", "items"):
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield f"{keyword}[{i}]", sub
