"""The embedded default model: a tiny random Llama built once into the cache directory."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("tandem.deploy")

EMBEDDED_MODEL_NAME = "tiny-llama"
EMBEDDED_MODEL_ARGS = {
    "arch": "llama",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 512,
    "seed": 0,
}


def ensure_embedded_model(cache_dir: Path) -> Path:
    """`cache_dir/models/tiny-llama`, built on first use (atomically, safe to race)."""
    target = cache_dir / "models" / EMBEDDED_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    from tandem.deploy.tiny_model import build_tiny_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        build_tiny_checkpoint(staging, **EMBEDDED_MODEL_ARGS)  # type: ignore[arg-type]
        try:
            os.rename(staging, target)
            logger.info("built the embedded tiny model in %s", target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
