"""The base of the API's request bodies (completions, chat, responses, tokenize).

- Text must be Unicode: a string with a lone UTF-16 surrogate is refused (`unicode_text`).
- An explicit JSON `null` for a field that has a default but no "none" value of its own
  (`"n": null`, `"stream": null`, `"echo": null`) means that default, as OpenAI's API reads
  its nullable fields and as clients that send every unset field as `null` expect. Fields that
  take `None` keep it (`"max_tokens": null` is the rest of the context, not the default).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, model_validator

from tandem.router.unicode_text import lone_surrogate_at


class RequestBody(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        if (where := lone_surrogate_at(data)) is not None:
            raise ValueError(
                f"{where.removeprefix('body.')} holds a lone UTF-16 surrogate (an unpaired "
                "\\ud800-\\udfff escape): not Unicode text"
            )
        if isinstance(data, dict) and None in data.values():
            defaulted = _null_means_default(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


@functools.cache
def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """`model`'s fields with a default whose type does not take None."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if not field.is_required() and not _takes_none(field.annotation)
    )


def _takes_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_takes_none(arg) for arg in get_args(annotation))
    if get_origin(annotation) is Literal:
        return None in get_args(annotation)
    return False
