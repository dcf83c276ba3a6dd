"""What of a JSON schema the structured-output grammar cannot enforce.

xgrammar turns a schema into a grammar and drops, with no more than a log line, the keywords it
cannot express: the output would then break the schema while the request ends "stop" as if it
held. Such a schema is refused instead (a 400 naming the keyword and where it is), as vLLM's
xgrammar backend refuses it.
"""

from __future__ import annotations

import re
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
"""Keywords beside a `$ref` or a combinator that constrain nothing there (any other one is
left out: the grammar enforces the `$ref` or the combinator alone)."""

COMBINATORS = ("anyOf", "oneOf", "allOf")
"""`oneOf` is enforced as `anyOf` (an output may match more than one branch), as vLLM's
xgrammar backend takes it: real schemas' branches rarely overlap."""


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
    if ref is not None and (extra := _constraining(schema, "$ref")):
        yield f"{', '.join(map(repr, extra))} beside a $ref (in {where})"
    for keyword in COMBINATORS:
        if isinstance(schema.get(keyword), list):
            if not schema[keyword]:
                yield f"an empty {keyword!r}, which no value matches (in {where})"
            if extra := _constraining(schema, keyword):
                yield f"{', '.join(map(repr, extra))} beside {keyword!r} (in {where})"
            break
    yield from _value_problems(schema, where)
    yield from _string_problems(schema, where)
    if "multipleOf" in schema and schema.get("type") != "integer":
        yield f"'multipleOf' on a non-integer (in {where})"
    properties, required = schema.get("properties"), schema.get("required")
    if isinstance(required, list) and required:
        missing = [name for name in required if name not in (properties or {})]
        if missing:
            yield f"required {missing} not among the properties (in {where})"
    for name, sub in _subschemas(schema):
        yield from _problems(sub, f"{where} > {name}")


def _constraining(schema: dict[str, Any], enforced: str) -> list[str]:
    """The keywords of `schema` beside `enforced` (a `$ref` or a combinator, which the grammar
    enforces alone there) that would constrain the value: not annotations, OpenAPI's
    `discriminator` (each branch's own `const` does its work) or `x-` extensions."""
    return sorted(
        k for k in set(schema) - ANNOTATIONS - {enforced, "discriminator"} if not k.startswith("x-")
    )


def _value_problems(schema: dict[str, Any], where: str) -> Iterator[str]:
    """A `type` no value has, or a `const` / `enum` value that is not of the schema's type
    (the grammar writes the value anyway)."""
    types = schema.get("type")
    allowed = [types] if isinstance(types, str) else types
    if not isinstance(allowed, list):
        return
    if not allowed:
        yield f"an empty 'type' list, which no value matches (in {where})"
        return
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    for value in values if isinstance(values, list) else ():
        if not any(_is_of_type(value, kind) for kind in allowed):
            yield f"the value {value!r}, which is not of type {types!r} (in {where})"


_PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {
    "null": type(None), "boolean": bool, "string": str, "array": list, "object": dict,
    "number": (int, float),
}  # fmt: skip


def _is_of_type(value: Any, kind: Any) -> bool:
    if kind == "integer":  # (1.0 is an integer to JSON Schema)
        whole = isinstance(value, float) and value.is_integer()
        return whole or (isinstance(value, int) and not isinstance(value, bool))
    python = _PYTHON_TYPES.get(kind) if isinstance(kind, str) else None
    if python is None:
        return True  # (an unknown type name: xgrammar's to refuse)
    return isinstance(value, python) and not (kind == "number" and isinstance(value, bool))


def _string_problems(schema: dict[str, Any], where: str) -> Iterator[str]:
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if isinstance(types, list) and types and "string" not in types:
        return  # (`format` of an integer or a number, e.g. OpenAPI's int32: an annotation)
    bounded = "minLength" in schema or "maxLength" in schema
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _matches_quote_or_backslash(pattern):
        yield (
            f"a 'pattern' that matches '\"' or '\\\\' (the grammar writes them unescaped: the "
            f"output would not be JSON) (in {where})"
        )
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


_ESCAPED = re.compile(r'\\(["\\]|x(22|5[cC])|u00(22|5[cC])|x\{0*(22|5[cC])\})')
"""A regular expression's escape for '"' or '\\' (as a character, by hex or unicode)."""


def _matches_quote_or_backslash(pattern: str) -> bool:
    """Whether `pattern` names '"' or '\\' as a character it may match: written as such, or
    in a character class that is not negated (`[^"]` excludes it: the grammar keeps such output
    JSON)."""
    in_class = negated = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escaped = _ESCAPED.match(pattern, i)  # (\\, \", \x22, \u005c, ...)
            if escaped and not (in_class and negated):
                return True
            i += len(escaped.group()) if escaped else 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            elif c == '"' and not negated:
                return True
        elif c == "[":
            in_class, negated = True, pattern[i + 1 : i + 2] == "^"
            i += 2 if negated else 1
            continue
        elif c == '"':
            return True
        i += 1
    return False
