"""`vllm serve`'s command-line flags that `tandem serve` takes: a vLLM command line runs as it
is, and a value tandem cannot honour is refused with why (exit 2), never dropped."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tandem.deploy.cluster_config import ClusterConfig


def _serve(monkeypatch: pytest.MonkeyPatch, model: Any, *flags: str) -> tuple[Any, list[Any]]:
    return _serve_args(monkeypatch, str(model), *flags)


def _serve_args(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, list[Any]]:
    import tandem.deploy.app_builder as app_builder
    from tandem.deploy.cli import app

    seen: list[ClusterConfig] = []

    def build_app(cfg: ClusterConfig) -> None:
        seen.append(cfg)
        raise ValueError("built")

    monkeypatch.setattr(app_builder, "build_app", build_app)
    return CliRunner().invoke(app, ["serve", *args]), seen


def test_a_vllm_command_line_runs_as_it_is(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Any
) -> None:
    """These flags were "No such option" (exit 2 before anything started)."""
    flags = ["--tensor-parallel-size", "1", "-pp", "1", "--enable-chunked-prefill",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--trust-remote-code", "--enforce-eager", "--disable-log-stats",
             "--disable-log-requests"]  # fmt: skip
    res, seen = _serve(monkeypatch, tiny_checkpoint(), *flags)
    assert res.exit_code == 2 and "built" in res.output, res.output
    assert seen[0].router.log_requests is False
    assert seen[0].router.tool_call_parser == "hermes"
    res, seen = _serve(monkeypatch, tiny_checkpoint(), "-tp", "1", "--enable-log-requests")
    assert "built" in res.output and seen[0].router.log_requests is True


def test_vllm_spellings_sizes_and_lists(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """`--max-model-len 1K` / `25.6k` (vLLM's sizes), `--max_num_batched_tokens` (underscores),
    `--served-model-name a b` (several names after one flag), and the flags tandem takes as
    what it always does: each was exit 2."""
    flags = ["--max_model_len", "1K", "--max-num-batched-tokens", "0.5k", "--served-model-name",
             "a", "b", "--swap-space", "4", "--kv-cache-dtype", "auto", "--load-format",
             "safetensors", "--max-seq-len-to-capture", "8192", "--disable-custom-all-reduce",
             "--task", "generate"]  # fmt: skip
    res, seen = _serve(monkeypatch, tiny_checkpoint(), *flags)
    assert res.exit_code == 2 and "built" in res.output, res.output
    assert seen[0].engine == {"max_model_len": 1024, "max_num_batched_tokens": 500}
    assert seen[0].served_model_name == ["a", "b"]
    res, seen = _serve(monkeypatch, tiny_checkpoint(), "--max-model-len", "1.5K")
    assert res.exit_code == 2 and not seen and "a fraction takes k, m, g or t" in res.output
    for auto in ("auto", "-1"):  # (vLLM's: the model's length)
        res, seen = _serve(monkeypatch, tiny_checkpoint(), "--max-model-len", auto)
        assert "built" in res.output and "max_model_len" not in seen[0].engine, res.output
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tiny_checkpoint()}\n")
    res, seen = _serve_args(monkeypatch, "--config", str(config), "--served-model-name", "a", "b")
    assert "built" in res.output and seen[0].served_model_name == ["a", "b"], res.output


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["-tp", "2"], "--tensor-parallel-size 2"),
        (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size 4"),
        (["--no-enable-chunked-prefill"], "raise --max-num-batched-tokens"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: tandem's KV cache"),
        (["--load-format", "gguf"], "--load-format gguf"),
        (["--task", "embed"], "--task embed: tandem serves text generation only"),
    ],
)
def test_what_tandem_cannot_honour_is_refused_with_why(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Any, flags: list[str], why: str
) -> None:
    res, seen = _serve(monkeypatch, tiny_checkpoint(), *flags)
    assert res.exit_code == 2 and not seen
    assert why in res.output and "Traceback" not in res.output, res.output


def test_the_request_log_is_off_with_log_requests_false(caplog: pytest.LogCaptureFixture) -> None:
    from tandem.router import request_record
    from tandem.router.request_timings import RequestTimings

    timings = RequestTimings()
    try:
        with caplog.at_level(logging.INFO, logger="tandem"):
            request_record.log_requests(False)
            request_record.log_left_early("cmpl-off", timings)
            request_record.log_requests(True)
            request_record.log_left_early("cmpl-on", timings)
    finally:
        request_record.log_requests(True)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split()[1] for line in lines] == ["cmpl-on"], lines
    assert ClusterConfig().router.log_requests is True
