"""Where `tandem bench serve` writes its result: `--save-result FILE`, or vLLM's form
`--save-result [--result-dir DIR] [--result-filename NAME] [--append-result]`, whose file is
named as vLLM names it unless given."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import typer


def result_path(
    save_result: str | None,
    result_dir: Path | None,
    result_filename: str | None,
    append: bool,
    name_parts: dict[str, Any],
) -> Path | None:
    """The file to write (None: none asked for). `save_result` "" is vLLM's flag; any of
    `--result-dir`, `--result-filename`, `--append-result` asks for the file too.
    `name_parts`: model, request_rate, max_concurrency, started, label (vLLM's default
    name)."""
    if save_result is None and result_dir is None and result_filename is None and not append:
        return None
    if save_result and result_filename and save_result != result_filename:
        raise ValueError(f"two result files given: {save_result} and {result_filename}")
    name = save_result or result_filename or default_name(**name_parts)
    return result_dir / name if result_dir is not None else Path(name)


def default_name(
    model: str, request_rate: float, max_concurrency: int | None, started: datetime, label: str
) -> str:
    """vLLM's: `{label}-{rate}qps[-concurrency{c}]-{model's last part}-{date}.json`."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base = model.rstrip("/").split("/")[-1]
    return f"{label}-{request_rate}qps{concurrency}-{base}-{started:%Y%m%d-%H%M%S}.json"


def write_result(path: Path, result: dict[str, Any], append: bool) -> None:
    """The result as indented JSON; appended, one JSON a line (vLLM's --append-result)."""
    if not append:
        path.write_text(json.dumps(result, indent=2) + "\n")
        return
    with path.open("a", encoding="utf-8") as out:
        if out.tell():
            out.write("\n")
        out.write(json.dumps(result))


def check_result_file(path: Path) -> None:
    """Its directory made and the file opened now: one that cannot be fails before the run,
    not after it with the result lost."""
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory", param_hint="--save-result")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as exc:
        raise typer.BadParameter(str(exc), param_hint="--save-result") from None
    if not existed:
        path.unlink()
