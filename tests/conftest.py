"""Shared pytest setup: offline Hugging Face, few torch threads, and tiny checkpoints.

`tiny_checkpoint(**kwargs)` builds a random checkpoint with
`tandem.deploy.tiny_model.build_tiny_checkpoint(out_dir, **kwargs)` once per session per distinct
set of keyword arguments, and returns its directory. Treat the directory as read-only: other tests
get the same one for the same arguments. Example::

    def test_something(tiny_checkpoint):
        path = tiny_checkpoint()                         # llama, 2 layers, hidden 64, vocab 512
        qwen = tiny_checkpoint(arch="qwen3", seed=1)     # any build_tiny_checkpoint keyword
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

TinyCheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpointFactory:
    """Factory fixture: ``tiny_checkpoint(**build_tiny_checkpoint_kwargs) -> Path`` (cached)."""
    from tandem.deploy.tiny_model import build_tiny_checkpoint

    cache: dict[str, Path] = {}

    def build(**kwargs: Any) -> Path:
        key = json.dumps(kwargs, sort_keys=True, default=repr)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{kwargs.get('arch', 'llama')}")
            cache[key] = build_tiny_checkpoint(out, **kwargs)
        return cache[key]

    return build
