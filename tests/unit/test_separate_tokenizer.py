"""A tokenizer kept apart from its checkpoint (vLLM's `tokenizer=` / `--tokenizer`): the engine,
the router's settings and every worker's engine use that directory's tokenizer and chat
template; eos ids and sampling defaults still come from the checkpoint's generation config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.errors import CheckpointError
from tandem.engine.tokenizer import TOKENIZER_FILES

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def split(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a checkpoint without tokenizer files, a directory with only its tokenizer, whose chat
    template differs and whose own generation config names another eos id)."""
    whole = Path(tiny_checkpoint())
    root = tmp_path_factory.mktemp("split")
    model, tokenizer = root / "model", root / "tokenizer"
    shutil.copytree(whole, model)
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (model / name).is_file():
            shutil.move(model / name, tokenizer / name)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TEMPLATE})
    )
    (tokenizer / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [0, 5]}))
    return model, tokenizer


def test_the_engine_uses_the_tokenizer_given_and_the_checkpoints_generation_eos(
    tiny_checkpoint: Any, split: tuple[Path, Path]
) -> None:
    model, tokenizer = split
    whole = LLM(model=str(tiny_checkpoint()), num_kv_blocks=32)
    apart = LLM(model=str(model), tokenizer=str(tokenizer), num_kv_blocks=32)
    expected = whole.generate(["hello world", "the cat"], GREEDY)
    got = apart.generate(["hello world", "the cat"], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert apart.get_tokenizer().chat_template == TEMPLATE
    assert apart.engine.eos_token_ids == {0, 5}  # (the tokenizer's eos, and the checkpoint's)
    assert apart.engine.config.tokenizer == str(tokenizer)
    with pytest.raises(CheckpointError, match="no tokenizer in"):
        LLM(model=str(model), num_kv_blocks=32)  # (its own, which it does not have)


def test_the_cluster_gives_every_engine_and_the_router_the_tokenizer(
    split: tuple[Path, Path],
) -> None:
    from tandem.deploy.app_builder import build_app
    from tandem.deploy.cluster_config import ClusterConfig

    model, tokenizer = split
    cfg = ClusterConfig(model=str(model), tokenizer=str(tokenizer) + "/")
    for role in ("prefill", "decode"):
        assert cfg.engine_config(role, str(model)).tokenizer == str(tokenizer) + "/"
    app = build_app(cfg)
    router_settings, prefill, decode = app._bound_deployment.init_args
    assert router_settings["tokenizer"] == str(tokenizer)  # (resolved)
    for worker in (prefill, decode):
        assert worker._bound_deployment.init_args[0]["engine"]["tokenizer"] == str(tokenizer)
    with pytest.raises(ValueError, match=r"misplaced engine settings: \['tokenizer'\]"):
        ClusterConfig(model=str(model), engine={"tokenizer": str(tokenizer)})
    with pytest.raises(CheckpointError, match="does not exist"):
        build_app(ClusterConfig(model=str(model), tokenizer=str(tokenizer / "nope")))
    with pytest.raises(CheckpointError, match="no tokenizer in"):
        build_app(ClusterConfig(model=str(model)))


def test_tandem_generate_takes_the_tokenizer(split: tuple[Path, Path]) -> None:
    from typer.testing import CliRunner

    from tandem.deploy.cli import app

    model, tokenizer = split
    args = ["generate", "--model", str(model), "--prompt", "hello", "--max-tokens", "4", "--json"]
    done = CliRunner().invoke(app, [*args, "--tokenizer", str(tokenizer)])
    assert done.exit_code == 0, done.output
    line = done.output[done.output.index('{"prompt"') :].splitlines()[0]  # (after the progress bar)
    assert len(json.loads(line)["token_ids"]) == 4
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "no tokenizer in" in refused.output
