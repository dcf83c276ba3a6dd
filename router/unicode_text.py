"""Text that is Unicode: JSON may carry a lone UTF-16 surrogate (`"\\ud800"`), which Python
decodes into a string that no tokenizer, log line or UTF-8 response can take. A request body
with one is refused up front (400, naming where), like any other bad field (`RequestBody`)."""

from __future__ import annotations

from typing import Any


def lone_surrogate_at(value: Any, where: str = "body") -> str | None:
    """Where in `value` (parsed JSON) a string holds a lone surrogate, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_at(key, where) or lone_surrogate_at(item, f"{where}.{key}")
            if found:
                return found
    elif isinstance(value, list) and not set(map(type, value)) <= {int}:  # (token ids: quick)
        for i, item in enumerate(value):
            if found := lone_surrogate_at(item, f"{where}.{i}"):
                return found
    return None
