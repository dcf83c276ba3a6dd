"""A Hugging Face repo id ("Qwen/Qwen2.5-0.5B-Instruct") as the local snapshot the Hugging Face
cache already holds (`huggingface-cli download`, or any transformers run): vLLM scripts name
models so. Nothing is downloaded: an id the cache lacks stays as given, and the loader says
that it is no local checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def cached_snapshot(model: str) -> str:
    """`model` itself, or the cached snapshot's directory of the repo id it names."""
    if Path(model).expanduser().exists() or not _REPO_ID.fullmatch(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, local_files_only=True))
    except Exception:  # (not cached, no such repo, an unreadable cache: as given)
        return model
