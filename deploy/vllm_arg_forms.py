"""vLLM command-line forms that typer does not read as they are, rewritten before it parses
them: options that take several values after one flag (argparse's `nargs="+"`, e.g.
`--served-model-name a b`), and option names spelt with underscores (`--max_model_len`,
which vLLM's parser reads as `--max-model-len`: `UNDERSCORES`, on the `tandem` app)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from typer.core import TyperCommand

UNDERSCORES = {"token_normalize_func": lambda name: name.replace("_", "-")}
"""Typer context settings: option names with underscores read as with dashes (values are
left as they are)."""


def dashed(arg: str) -> str:
    """An option's name with dashes for underscores (`--max_model_len=8` is
    `--max-model-len=8`), as typer reads it under `UNDERSCORES`; other arguments as they are."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def repeat_values(args: list[str], options: Collection[str]) -> list[str]:
    """`args` with `--opt a b` (an option of `options` followed by several values) as `--opt a
    --opt b`; anything else as it is."""
    out: list[str] = []
    current, after_it = "", False  # (the option the last values belong to; right after it)
    for arg in args:
        if arg.startswith("-"):
            current, after_it = dashed(arg), True
            out.append(arg)
            continue
        out += [current, arg] if current in options and not after_it else [arg]
        after_it = False
    return out


def rewriting(rewrite: Callable[[list[str]], list[str]]) -> type[TyperCommand]:
    """A typer command class whose arguments go through `rewrite` before they are parsed."""

    class Rewriting(TyperCommand):
        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
            return super().parse_args(ctx, rewrite(list(args)))

    return Rewriting
