"""A model named by its Hugging Face repo id loads from the snapshot the Hugging Face cache
holds, as vLLM scripts name models; nothing is downloaded."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.deploy.app_builder import resolve_model
from tandem.deploy.cluster_config import ClusterConfig
from tandem.engine.config import EngineConfig
from tandem.engine.errors import CheckpointError
from tandem.engine.hub_cache import cached_snapshot


@pytest.fixture
def hub_cache(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A Hugging Face cache holding `acme/tiny-chat` (the tiny checkpoint) at one revision."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_checkpoint(), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_repo_id_the_cache_holds_is_its_snapshot(
    hub_cache: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    assert cached_snapshot("acme/tiny-chat") == str(hub_cache)
    assert EngineConfig(model="acme/tiny-chat").model == str(hub_cache)
    assert resolve_model(ClusterConfig(model="acme/tiny-chat")) == str(hub_cache.resolve())
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_id = LLM(model="acme/tiny-chat", num_kv_blocks=16).generate("hi", greedy)[0]
    by_path = LLM(model=str(tiny_checkpoint()), num_kv_blocks=16).generate("hi", greedy)[0]
    assert by_id.token_ids == by_path.token_ids


def test_an_id_the_cache_lacks_is_refused_as_no_local_checkpoint(hub_cache: Path) -> None:
    assert cached_snapshot("acme/absent") == "acme/absent"
    assert cached_snapshot("./relative/dir") == "./relative/dir"  # (not an id: as given)
    with pytest.raises(CheckpointError, match="the Hugging Face cache holds; nothing is"):
        LLM(model="acme/absent")
