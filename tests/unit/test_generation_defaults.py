"""A model's sampling defaults from its generation_config.json (`engine/generation_defaults.py`):
what is read, the offline `LLM` without SamplingParams, and the router's requests that leave
fields out (a request's own values win)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.generation_defaults import sampling_defaults
from tandem.router.admission import Admission, AdmissionConfig
from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving

QWEN3_LIKE = {
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "eos_token_id": [1, 2],
}


def _with_generation_config(src: Path, dst: Path, **fields: Any) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return dst


def test_the_sampling_fields_are_read_and_checked(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({**QWEN3_LIKE, "repetition_penalty": 1.1, "max_new_tokens": 7, "min_p": 0.0})
    )
    assert sampling_defaults(tmp_path) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "max_tokens": 7,
        "min_p": 0.0,
    }
    assert sampling_defaults(tmp_path, "none") == sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path / "elsewhere") == {}  # no file: no defaults
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(tmp_path, str(tmp_path / "elsewhere"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0, "temperature": 1}))
    assert sampling_defaults(tmp_path) == {"top_k": 0, "temperature": 1}  # 0: no top-k
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(tmp_path)


@pytest.fixture(scope="module")
def greedy_model(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, whose generation_config.json asks for greedy, 5 tokens at most."""
    out = tmp_path_factory.mktemp("greedy") / "model"
    return _with_generation_config(tiny_checkpoint(), out, temperature=0.0, max_new_tokens=5)


def test_llm_without_sampling_params_uses_the_model_defaults(greedy_model: Path) -> None:
    prompt = [5, 6, 7, 8]
    llm = LLM(model=str(greedy_model), num_kv_blocks=64)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0].token_ids
    assert llm.generate([prompt])[0].token_ids == want
    plain = LLM(model=str(greedy_model), num_kv_blocks=64, generation_config="none")
    assert plain.get_default_sampling_params() == SamplingParams()


class _Orchestrator:
    def __init__(self) -> None:
        self.reserved: list[dict[str, Any]] = []

    async def limits(self) -> dict[str, Any]:
        return {"max_model_len": 100, "vocab_size": 512}

    async def reserve(self, plan: Any, rid: str, prompt: list[int], params: dict[str, Any],
                      *args: Any) -> None:  # fmt: skip
        self.reserved.append(params)


class _Planner:
    policy_name = "least_loaded"
    admission = Admission(AdmissionConfig())

    async def plan(self, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(prefill=None, decode=SimpleNamespace(worker_id="decode/a"),
                               decode_hit_blocks=0, grant=None, release=lambda: None)  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "max_tokens", "want"),
    [
        # nothing asked: the model's values, max_tokens capped by max_new_tokens
        ({}, None, {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7}),
        # the request's own values win, field by field, max_tokens too (vLLM's rule since
        # its PR 34063: the model's max_new_tokens is a default, not a ceiling)
        ({"temperature": 0.0, "top_k": 5}, 30,
         {"temperature": 0.0, "top_k": 5, "top_p": 0.95, "max_tokens": 30}),
        ({}, 5, {"temperature": 0.6, "max_tokens": 5}),
    ],
)  # fmt: skip
def test_the_router_fills_in_what_a_request_leaves_out(
    fields: dict[str, Any], max_tokens: int | None, want: dict[str, Any]
) -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7}
    orchestrator = _Orchestrator()
    serving = Serving(orchestrator, _Planner(), None, "tiny", sampling_defaults=defaults)  # type: ignore[arg-type]
    req = asyncio.run(serving.prepare("r1", "tiny", [3] * 10, max_tokens, fields, RequestTimings()))
    got = req.params.model_dump()
    assert {k: got[k] for k in want} == want
    assert orchestrator.reserved[0]["max_tokens"] == want["max_tokens"]
    bare = Serving(_Orchestrator(), _Planner(), None, "tiny")  # type: ignore[arg-type]
    req = asyncio.run(bare.prepare("r2", "tiny", [3] * 10, None, {}, RequestTimings()))
    assert (req.params.temperature, req.params.top_k, req.params.max_tokens) == (1.0, 0, 90)


def test_another_folders_max_new_tokens_caps_every_request() -> None:
    """vLLM's `--generation-config DIR`: that file's max_new_tokens is a ceiling too."""
    from tandem.engine.generation_defaults import max_tokens_ceiling

    defaults = {"max_tokens": 7}
    assert max_tokens_ceiling(defaults, "auto") is None
    assert max_tokens_ceiling(defaults, "vllm") is None
    assert max_tokens_ceiling(defaults, "/some/dir") == 7
    serving = Serving(_Orchestrator(), _Planner(), None, "tiny",  # type: ignore[arg-type]
                      sampling_defaults=defaults, max_tokens_ceiling=7)  # fmt: skip
    for asked in (30, None, 5):
        req = asyncio.run(serving.prepare("r", "tiny", [3] * 10, asked, {}, RequestTimings()))
        assert req.params.max_tokens == (5 if asked == 5 else 7)


def test_max_new_tokens_is_capped_by_the_context() -> None:
    serving = Serving(_Orchestrator(), _Planner(), None, "tiny",  # type: ignore[arg-type]
                      sampling_defaults={"max_tokens": 500})  # fmt: skip
    req = asyncio.run(serving.prepare("r", "tiny", [3] * 95, None, {}, RequestTimings()))
    assert req.params.max_tokens == 5  # 100-token context, 95-token prompt
