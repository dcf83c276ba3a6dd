"""The engine's cache namespace changes with everything that changes hidden state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tandem import LLM


def _digest(path: Path | str, **kwargs: Any) -> str:
    return LLM(
        model=str(path), num_kv_blocks=8, max_model_len=64, **kwargs
    ).engine.namespace.digest()


def test_namespace_digests_model_tokenizer_rope_and_kv_dtype(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    base = tiny_checkpoint()
    ref = _digest(base)
    assert _digest(base) == ref  # stable
    assert _digest(base, dtype="bfloat16") != ref  # KV dtype
    assert _digest(tiny_checkpoint(seed=1)) != ref  # other weights
    assert _digest(base, model_revision="v2") != ref  # explicit revision

    template = tmp_path / "template"
    shutil.copytree(base, template)
    cfg_path = template / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = cfg["chat_template"] + " "
    cfg_path.write_text(json.dumps(cfg))
    assert _digest(template, model_revision="same") != _digest(base, model_revision="same")

    rope = tmp_path / "rope"
    shutil.copytree(base, rope)
    conf = json.loads((rope / "config.json").read_text())
    conf["rope_parameters"]["rope_theta"] = 5000.0
    (rope / "config.json").write_text(json.dumps(conf))
    assert _digest(rope, model_revision="same") != _digest(base, model_revision="same")
