"""Settings and checkpoints that could never serve are refused in one line before anything
starts: engine flags win over a role's own settings in the file, prefill and decode must agree on
the KV layout, a missing transport package, Triton kernels on the CPU, projections that do not
stack, an index without a weight map, a config.json transformers refuses."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tandem import LLM
from tandem.deploy.app_builder import check_roles_agree
from tandem.deploy.cli import app
from tandem.deploy.cluster_config import ClusterConfig
from tandem.deploy.cluster_config_flags import cluster_config_from as _config
from tandem.engine.config import EngineConfig
from tandem.engine.errors import CheckpointError


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tandem serve` fails instead of starting Ray (where a refusal this file tests is missing)."""
    import tandem.deploy.serve_cmd as serve_cmd

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tandem serve went on to start Ray")

    monkeypatch.setattr(serve_cmd, "start_ray", refuse)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_engine_flags_win_over_a_role_s_own_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("decode:\n  engine:\n    max_model_len: 1024\n    num_kv_blocks: 64\n")
    flags = {("engine", "max_model_len"): 512, ("engine", "dtype"): "float32"}
    cfg = _config(path, {}, {}, flags)
    assert cfg.decode.engine == {"num_kv_blocks": 64}  # (its other settings stay)
    assert cfg.engine_config("decode", "/m").max_model_len == 512
    assert cfg.engine_config("prefill", "/m").max_model_len == 512
    assert _config(path, {}, {}, {}).engine_config("decode", "/m").max_model_len == 1024


@pytest.mark.parametrize(
    ("role_engine", "named"),
    [({"dtype": "bfloat16"}, "dtype"), ({"block_size": 32}, "block_size")],
)
def test_prefill_and_decode_must_agree_on_the_kv_layout(
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    role_engine: dict[str, object],
    named: str,
    no_ray: None,
) -> None:
    model = str(tiny_checkpoint())
    cfg = ClusterConfig.model_validate({"model": model, "decode": {"engine": role_engine}})
    with pytest.raises(ValueError, match=f"must agree on {named}"):
        check_roles_agree(cfg, model)
    check_roles_agree(ClusterConfig.model_validate({"model": model}), model)
    file = tmp_path / "roles.json"
    file.write_text(json.dumps({"decode": {"engine": role_engine}}))
    args = ["serve", "--model", model, "--address", "local", "--config", str(file)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert f"must agree on {named}" in result.output.splitlines()[-1]


def test_a_transport_whose_package_is_missing_is_refused_before_ray(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, no_ray: None
) -> None:
    monkeypatch.setitem(sys.modules, "ucxx", None)
    monkeypatch.delitem(sys.modules, "tandem.kv_transfer.ucx", raising=False)
    monkeypatch.delitem(sys.modules, "tandem.kv_transfer._ucx_lanes", raising=False)
    result = CliRunner().invoke(
        app,
        ["serve", "--model", str(tiny_checkpoint()), "--address", "local", "--transport", "ucx"],
    )
    assert result.exit_code == 2
    last = result.output.splitlines()[-1]
    assert last.startswith("Error: KV transport 'ucx' is not available") and "[ucx]" in last


def test_triton_kernels_on_the_cpu_are_refused(tiny_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="CUDA only"):
        EngineConfig(model=str(tiny_checkpoint()), device="cpu", attention_backend="triton")


def test_projections_that_do_not_stack_are_named(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    import torch

    path = _copy(tiny_checkpoint(), tmp_path / "q")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight \(3, 3\)"
    ):
        LLM(model=str(path), device="cpu")


@pytest.mark.parametrize("index", [[], {}, {"weight_map": ["a"]}])
def test_an_index_without_a_weight_map_is_named(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, index: object
) -> None:
    path = _copy(tiny_checkpoint(), tmp_path / "idx")
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="has no weight_map"):
        LLM(model=str(path), device="cpu")


def test_a_config_transformers_refuses_is_a_checkpoint_error(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = _copy(tiny_checkpoint(), tmp_path / "cfg")
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=66, head_dim=None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not a multiple of the number of attention heads"):
        LLM(model=str(path), device="cpu")


def test_a_pool_that_holds_no_request_is_refused(tiny_checkpoint: Callable[..., Path]) -> None:
    from tandem.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="the KV pool holds 1 token"):
        LLM(model=str(tiny_checkpoint()), device="cpu", num_kv_blocks=1, block_size=1)


def test_a_transport_option_of_the_wrong_type_is_named() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="option port: 'x' is not of type int"):
        ClusterConfig.model_validate({"transport": "torch", "transport_options": {"port": "x"}})
    config = {"transport": "shm", "transport_options": {"timeout": 2, "pull": None}}
    assert ClusterConfig.model_validate(config).transport_options["timeout"] == 2
