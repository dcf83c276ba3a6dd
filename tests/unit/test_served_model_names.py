"""Several names for one model (vLLM's `--served-model-name a b`): each is accepted as a
request's `model` and listed by `/v1/models` with the checkpoint as its root; replies carry
the first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tandem.deploy.cli import app
from tandem.deploy.cluster_config import ClusterConfig
from tandem.router.errors import APIError
from tandem.router.model_cards import models_body
from tandem.router.serving import Serving


def test_the_names_default_to_the_checkpoint_folder(tmp_path: Any) -> None:
    assert ClusterConfig().model_names("/models/qwen3-0.6b") == ["qwen3-0.6b"]
    # the path as given is vLLM's name for it: also taken; a repo id is the only name
    given = str(tmp_path / "qwen3-0.6b")
    (tmp_path / "qwen3-0.6b").mkdir()
    assert ClusterConfig(model=given).model_names(given) == ["qwen3-0.6b", given]
    assert ClusterConfig(model=given + "/").model_names(given) == ["qwen3-0.6b", given + "/"]
    snapshot = "/hf/models--Qwen--Qwen3-0.6B/snapshots/0123abcd"
    assert ClusterConfig(model="Qwen/Qwen3-0.6B").model_names(snapshot) == ["Qwen/Qwen3-0.6B"]
    assert ClusterConfig(served_model_name="m").model_names("/x/y") == ["m"]
    both = ClusterConfig(served_model_name=["a", "b"])
    assert both.model_names("/x/y") == ["a", "b"]


@pytest.mark.parametrize("names", [[], [""], ["a", " "], ["a", "a"], ""])
def test_empty_or_repeated_names_are_refused(names: Any) -> None:
    with pytest.raises(ValueError, match="served_model_name"):
        ClusterConfig(served_model_name=names)


def test_every_name_is_served_and_replies_carry_the_first() -> None:
    serving = Serving(None, None, None, ["main", "alias"])  # type: ignore[arg-type]
    assert serving.model_name == "main"
    serving.check_model("alias")
    serving.check_model("main")
    serving.check_model(None)  # (a request without a model gets the first)
    with pytest.raises(APIError) as refused:
        serving.check_model("mai")
    assert refused.value.status == 404 and "`main`, `alias`" in refused.value.message


def test_the_models_list_has_a_card_per_name_rooted_at_the_checkpoint() -> None:
    body = models_body(["main", "alias"], "/models/ckpt", 4096)
    assert [(c["id"], c["root"], c["max_model_len"]) for c in body["data"]] == [
        ("main", "/models/ckpt", 4096),
        ("alias", "/models/ckpt", 4096),
    ]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[ClusterConfig]:
    """The configs `tandem serve` builds its app from (it stops there, before Ray)."""
    import tandem.deploy.app_builder as app_builder

    seen: list[ClusterConfig] = []

    def build_app(cfg: ClusterConfig) -> None:
        seen.append(cfg)
        raise ValueError("built")

    monkeypatch.setattr(app_builder, "build_app", build_app)
    return seen


def test_the_cli_option_repeats(
    tiny_checkpoint: Callable[..., Path], built: list[ClusterConfig]
) -> None:
    model = str(tiny_checkpoint())
    args = ["serve", "--model", model, "--served-model-name", "a", "--served-model-name", "b"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "built" in res.output, res.output
    assert built[0].model_names(model) == ["a", "b"]
    CliRunner().invoke(app, ["serve", "--model", model, "--served-model-name", "a"])
    assert built[1].model_names(model) == ["a"]


def test_a_repo_id_is_the_models_name_as_vllm_names_it(
    tiny_checkpoint: Callable[..., Path],
    built: list[ClusterConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model the Hugging Face cache holds, named by its repo id: served under that id (it
    was named by its snapshot folder, a commit hash)."""
    import shutil

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_checkpoint(), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    res = CliRunner().invoke(app, ["serve", "org/tiny"])
    assert res.exit_code == 2 and "built" in res.output, res.output
    assert built[0].model == str(snapshot.resolve())
    assert built[0].model_names(built[0].model) == ["org/tiny"]


def test_the_model_may_come_first_as_vllm_serve_takes_it(
    tiny_checkpoint: Callable[..., Path], built: list[ClusterConfig]
) -> None:
    """`tandem serve PATH` as `vllm serve PATH`; two different models are refused."""
    model = str(tiny_checkpoint())
    res = CliRunner().invoke(app, ["serve", model, "--served-model-name", "a"])
    assert res.exit_code == 2 and "built" in res.output, res.output
    assert built[0].model == str(Path(model).resolve())
    res = CliRunner().invoke(app, ["serve", model, "--model", "/elsewhere"])
    assert res.exit_code == 2 and "two models given" in res.output and len(built) == 1
