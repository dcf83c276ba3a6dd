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
    {"$ref", "title", "description", "default", "examples", "example", "$comment", "deprecated",
     "readOnly", "writeOnly", "$defs", "definitions", "$schema", "$id", "$anchor",
     "contentMediaType", "contentEncoding"}
)  # fmt: skip
"""Keywords beside a `$ref` or a combinator that constrain nothing there (any other one is
left out: the grammar enforces the `$ref` or the combinator alone)."""

COMBINATORS = ("anyOf", "oneOf", "allOf")
"""`oneOf` is enforced as `anyOf` (an output may match more than one branch), as vLLM's
xgrammar backend takes it: real schemas' branches rarely overlap."""


def unenforced(schema: Any) -> str | None:
    """The first part of `schema` the grammar would not enforce, said with where it is; None
    when the grammar holds the output to all of it."""
    try:
        return next(_problems(schema, "the schema"), None)
    except RecursionError:  # (deeper than Python's stack: a grammar would not be built either)
        return "a schema nested too deeply"


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
    allowed = _type_names(schema)
    if allowed is None:
        return
    if not allowed:
        yield f"an empty 'type' list, which no value matches (in {where})"
        return
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    for value in values if isinstance(values, list) else ():
        if not any(_is_of_type(value, kind) for kind in allowed):
            yield f"the value {value!r}, which is not of type {types!r} (in {where})"


def _type_names(schema: dict[str, Any]) -> list[Any] | None:
    """The schema's `type` as a list (None: no type, or not a name nor a list)."""
    types = schema.get("type")
    return [types] if isinstance(types, str) else types if isinstance(types, list) else None


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
    types = _type_names(schema)
    if types and "string" not in types:
        return  # (`format` of an integer or a number, e.g. OpenAPI's int32: an annotation)
    bounded = "minLength" in schema or "maxLength" in schema
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _names_json_escaped_character(pattern):
        yield (
            f"a 'pattern' that matches '\"', '\\\\' or a control character (the grammar writes "
            f"them unescaped: the output would not be JSON) (in {where})"
        )
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in STRING_FORMATS:
        yield f"the string format {fmt!r} (in {where}; known: {', '.join(sorted(STRING_FORMATS))})"
    for keyword in ("pattern", "format"):
        if keyword in schema and bounded:
            yield f"{keyword!r} with minLength/maxLength (in {where})"


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for keyword in ("properties", "$defs", "definitions"):
        named = schema.get(keyword)
        for name, sub in named.items() if isinstance(named, dict) else ():
            yield f"{keyword}.{name}", sub
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            yield keyword, schema[keyword]
    for keyword in ("prefixItems", "anyOf", "oneOf", "allOf", "items"):
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield f"{keyword}[{i}]", sub


_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|u\{[0-9A-Fa-f]+\}|c[A-Za-z]|.)", re.S)
"""One escape of a regular expression: by hex (\\x22), by unicode (\\u0022, \\u{22}), a
control letter (\\cJ), or a character (\\n, \\", \\d)."""

_CONTROL_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}


def _escaped_code(escape: str) -> int | None:
    """The character an escape names (None: a class such as \\d, or an anchor)."""
    body = escape[1:]
    if body[0] in "xu" and len(body) > 1:
        return int(body[1:].strip("{}"), 16)
    if body[0] == "c" and len(body) == 2:
        return ord(body[1].upper()) - 0x40
    if body in _CONTROL_ESCAPES:
        return _CONTROL_ESCAPES[body]
    return ord(body) if not body.isalnum() else None


def _must_be_escaped(code: int | None) -> bool:
    """Whether JSON writes this character escaped in a string: '"', '\\', U+0000 - U+001F."""
    return code is not None and (code < 0x20 or code in (0x22, 0x5C))


def _names_json_escaped_character(pattern: str) -> bool:
    """Whether `pattern` names a character JSON writes escaped ('"', '\\', a control
    character) as one it may match: written as such or by an escape, alone or in a character
    class that is not negated. xgrammar writes such a character raw (the output would not be
    JSON); a negated class (`[^"]`) or `.` / `\\s` / `\\W` keep them out."""
    in_class = negated = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and (escape := _ESCAPE.match(pattern, i)):
            if _must_be_escaped(_escaped_code(escape.group())) and not (in_class and negated):
                return True
            i = escape.end()
            continue
        if in_class and c == "]":
            in_class = False
        elif not in_class and c == "[":
            in_class, negated = True, pattern[i + 1 : i + 2] == "^"
            i += 2 if negated else 1
            continue
        elif _must_be_escaped(ord(c)) and not (in_class and negated):
            return True
        i += 1
    return False
