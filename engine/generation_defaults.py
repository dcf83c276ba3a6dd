"""A model's own sampling defaults, from its ``generation_config.json`` (as vLLM applies them).

Model makers ship the settings a model was tuned to sample with, e.g. Qwen3's temperature 0.6,
top_k 20, top_p 0.95. A request that leaves such a field out gets the model's value; one that
sets it keeps its own. Only sampling fields are read: ``do_sample`` is not (vLLM ignores it too;
``temperature: 0`` asks for greedy), and the end-of-sequence ids are read elsewhere
(`tokenizer.generation_eos_ids`).

`source` is ``"auto"`` (the model directory's file), ``"none"`` or vLLM's ``"vllm"`` (no model
defaults: OpenAI's), or a directory holding another ``generation_config.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json name -> SamplingParams name."""


def max_tokens_ceiling(defaults: dict[str, Any], source: str = "auto") -> int | None:
    """What caps a request's own `max_tokens`: another folder's `max_new_tokens` (vLLM's
    `--generation-config DIR`); the model's own is only a default for requests that give none."""
    return None if source in ("auto", "none", "vllm") else defaults.get("max_tokens")


def sampling_defaults(model_dir: str | Path, source: str = "auto") -> dict[str, Any]:
    """The SamplingParams defaults `source` gives for the model in `model_dir` (see the
    module docstring); ``{}`` when there is no file or it sets none of the fields."""
    if source in ("none", "vllm"):
        return {}
    folder = Path(model_dir) if source == "auto" else Path(source).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"generation_config {source!r}: no generation_config.json there")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {
        ours: data[theirs]
        for theirs, ours in SAMPLING_FIELDS.items()
        if isinstance(data.get(theirs), int | float) and not isinstance(data.get(theirs), bool)
    }
    try:  # once here, rather than a 400 for every request that leaves them out
        SamplingParams(**defaults)
    except (InvalidRequestError, ValueError) as exc:
        raise ValueError(f"{path}: its sampling settings {defaults} are not valid: {exc}") from None
    if defaults:
        log.info("sampling defaults from %s: %s (a request's own values win)", path, defaults)
    return defaults
