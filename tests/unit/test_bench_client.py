"""`tandem bench serve` against a fake streaming server: records, arrivals, concurrency, CLI."""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tandem.bench.serving.datasets import Conversation, Turn, multi_turn_dataset
from tandem.bench.serving.prompts import WordPrompts
from tandem.bench.serving.runner import LoadConfig, arrival_times, run_load
from tandem.deploy.cli import app
from tests.unit.fake_openai_server import FakeServer


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    srv = FakeServer().start()
    yield srv
    srv.stop()


def load(server: FakeServer, **kw: object) -> LoadConfig:
    return LoadConfig(server.base_url, "fake", progress=False, **kw)  # type: ignore[arg-type]


def test_streamed_requests_are_recorded_and_failures_counted(server: FakeServer) -> None:
    convs = [
        Conversation("ok", [Turn("one two three", 5)]),  # chunks of 2 + 2 + 1 tokens
        Conversation("refused", [Turn("a b", 13)]),
        Conversation("broken", [Turn("a b", 14)]),
    ]
    out = asyncio.run(run_load(load(server), convs, WordPrompts()))
    ok, refused, broken = sorted(out.records, key=lambda r: r.max_tokens)
    assert ok.success and (ok.prompt_len, ok.output_tokens) == (3, 5)
    assert ok.generated_text == " w0 w1 w2 w3 w4" and len(ok.itl) == 2
    assert ok.ttft > 0 and ok.latency >= ok.ttft + sum(ok.itl) - 1e-9
    assert not refused.success and refused.error.startswith("HTTP 429")
    assert not broken.success and broken.error == "decode worker died"
    assert out.duration >= ok.latency


def test_max_concurrency_caps_requests_in_flight(server: FakeServer) -> None:
    server.max_in_flight = 0
    convs = [Conversation("c", [Turn(f"p {i}", 6)]) for i in range(6)]
    out = asyncio.run(run_load(load(server, max_concurrency=2), convs, WordPrompts()))
    assert all(r.success for r in out.records) and server.max_in_flight == 2


def test_a_conversation_sends_its_history_with_each_turn(server: FakeServer) -> None:
    server.prompts.clear()
    maker = WordPrompts()
    convs = multi_turn_dataset(maker, random.Random(0), 3, 3, 4, 2, 2, prefix="sys")
    out = asyncio.run(run_load(load(server), convs, maker))
    first, second, third = server.prompts
    assert second.startswith(f"{first} w0 w1 ") and third.startswith(f"{second} w0 w1 ")
    assert first.startswith("sys ") and [r.prompt_len for r in out.records] == [5, 9, 13]


def test_arrivals_are_gamma_with_the_requested_rate_and_burstiness() -> None:
    assert arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5)):
        times = arrival_times(4001, 4.0, burstiness, seed=1)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert times[0] == 0.0 and statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.08)


def test_the_cli_saves_vllm_keys(server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = ["bench", "serve", "--base-url", server.base_url, "--model", "fake", "--num-prompts",
            "4", "--random-input-len", "8", "--random-output-len", "4", "--goodput", "ttft:5000",
            "--save-result", str(out), "--save-detailed", "--disable-tqdm"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "Serving Benchmark Result" in res.output and "P99 ITL (ms):" in res.output
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 16)
    assert result["total_input_tokens"] == 32 and result["request_goodput"] > 0
    assert len(result["ttfts"]) == len(result["itls"]) == len(result["latencies"]) == 4
    assert result["request_rate"] == "inf" and result["dataset_name"] == "random"


def test_the_cli_sends_the_api_key_and_sizes_word_prompts_by_the_servers_count(
    tmp_path: Path,
) -> None:
    srv = FakeServer(tokenize=True).start()
    try:
        args = ["bench", "serve", "--base-url", srv.base_url, "--model", "fake", "--num-prompts",
                "6", "--random-input-len", "40", "--random-output-len", "2", "--disable-tqdm"]  # fmt: skip
        res = CliRunner().invoke(app, args, env={"OPENAI_API_KEY": "sekrit"})
        assert res.exit_code == 0, res.output
        assert srv.authorizations and set(srv.authorizations) == {"Bearer sekrit"}
        counted = [sum(3 if len(w) > 5 else 2 for w in p.split()) for p in srv.prompts]
        assert len(counted) == 6 and all(30 <= n <= 50 for n in counted), counted
        res = CliRunner().invoke(app, [*args, "--api-key", "other"], env={"OPENAI_API_KEY": ""})
        assert res.exit_code == 0 and srv.authorizations[-1] == "Bearer other"
    finally:
        srv.stop()


def test_word_prompts_without_a_count_are_a_word_a_token() -> None:
    maker = WordPrompts.calibrated(lambda text: 3 * len(text.split()))
    prompt = maker.random(random.Random(0), 30)
    assert isinstance(prompt, str) and len(prompt.split()) == 10 and maker.length(prompt) == 30
    assert len(str(WordPrompts().random(random.Random(0), 30)).split()) == 30


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--percentiles", "50,150"], "Invalid value for --percentiles: each must be in [0, 100]"),
        (["--request-rate", "0"], "Invalid value for --request-rate: 0.0 is not > 0"),
        (["--burstiness", "-1"], "Invalid value for --burstiness: -1.0 is not > 0"),
        (["--tokenizer", "FILE"], "Invalid value for --tokenizer: FILE is not a tokenizer"),
        (["--save-result", "DIR"], "Invalid value for --save-result: DIR is a directory"),
        (["--save-result", "/proc/r.json"], "Invalid value for --save-result: [Errno"),
        (["--save-result", "a.json", "--result-filename", "b.json"], "two result files given"),
        (["--percentile-metrics", "ttft,foo"], "foo: name some of ttft,tpot,itl,e2el"),
    ],
)
def test_the_cli_refuses_bad_options_before_the_run(
    server: FakeServer, tmp_path: Path, extra: list[str], error: str
) -> None:
    (tmp_path / "file").write_text("x")
    paths = {"FILE": str(tmp_path / "file"), "DIR": str(tmp_path)}
    extra = [paths.get(a, a) for a in extra]
    sent = len(server.prompts)
    args = ["bench", "serve", "--base-url", server.base_url, "--model", "fake", "--disable-tqdm"]
    res = CliRunner().invoke(app, [*args, *extra])
    assert res.exit_code == 2, res.output
    flat = " ".join(res.output.replace("│", " ").split())
    expected = error.replace("FILE", paths["FILE"]).replace("DIR", paths["DIR"])
    assert expected in flat, res.output
    assert len(server.prompts) == sent  # (nothing was sent)


def test_the_cli_stops_at_once_when_no_server_answers() -> None:
    url = "http://127.0.0.1:1"
    res = CliRunner().invoke(app, ["bench", "serve", "--base-url", url, "--model", "fake"])
    assert res.exit_code == 2, res.output
    assert res.output.splitlines()[-1].startswith(f"Error: no server answers at {url}: ")


def test_the_model_is_the_servers_unless_given_and_a_wrong_one_stops_the_run() -> None:
    """As vLLM's bench: no --model takes the first /v1/models lists; a model the server does
    not serve stops before the run (every request of it was sent to a 404)."""
    srv = FakeServer(models=("served",)).start()
    try:
        args = ["bench", "serve", "--base-url", srv.base_url, "--num-prompts", "2",
                "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm"]  # fmt: skip
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0 and "[bench] --model served (the server's)" in res.output
        assert srv.models_asked == ["served", "served"]
        res = CliRunner().invoke(app, [*args, "--model", "other"])
        flat = " ".join(res.output.replace("│", " ").split())
        assert res.exit_code == 2 and "the server serves served, not 'other'" in flat
        assert len(srv.prompts) == 2  # (nothing more was sent)
    finally:
        srv.stop()


def test_vllms_result_flags_name_and_append_the_file(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--save-result` as vLLM's flag (it took the next option for the file's path),
    `--result-dir`, `--result-filename`, `--append-result`, `--percentile-metrics`,
    `--metric-percentiles`."""
    monkeypatch.chdir(tmp_path)
    base = ["bench", "serve", "--base-url", server.base_url, "--model", "org/fake",
            "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2"]  # fmt: skip
    res = CliRunner().invoke(app, [*base, "--max-concurrency", "2", "--save-result",
                                   "--disable-tqdm"])  # fmt: skip
    assert res.exit_code == 0, res.output
    (named,) = tmp_path.glob("*.json")
    assert re.fullmatch(r"openai-infqps-concurrency2-fake-\d{8}-\d{6}\.json", named.name)
    assert json.loads(named.read_text())["completed"] == 2
    flags = ["--save-result", "--result-dir", "out", "--result-filename", "r.json",
             "--append-result", "--percentile-metrics", "ttft,e2el",
             "--metric-percentiles", "50", "--disable-tqdm"]  # fmt: skip
    for _ in range(2):
        res = CliRunner().invoke(app, [*base, *flags])
        assert res.exit_code == 0, res.output
    lines = (tmp_path / "out" / "r.json").read_text().split("\n")
    results = [json.loads(line) for line in lines]
    assert len(results) == 2 and all(r["completed"] == 2 for r in results)
    assert {k for k in results[0] if k.endswith("_ms")} - {"goodput_slos_ms"} == {
        f"{stat}_{name}_ms"
        for stat in ("mean", "median", "std", "p50")
        for name in ("ttft", "e2el")
    }
    assert "P50 TTFT (ms):" in res.output and "TPOT" not in res.output


def test_a_vllm_bench_command_line_runs_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Any
) -> None:
    """--backend, --host / --port, --served-model-name (--model: the tokenizer's checkpoint),
    --top-p / --top-k / --min-p, --num-warmups, --label, --metadata, --trust-remote-code,
    --random-prefix-len, --input-len / --output-len, `--goodput a b` (several values after one
    flag), underscores (`--num_prompts`) were "No such option" or an extra argument."""
    monkeypatch.chdir(tmp_path)
    srv = FakeServer(models=("served",)).start()
    try:
        args = ["bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port",
                str(srv.port), "--model", str(tiny_checkpoint()), "--served-model-name", "served",
                "--num_prompts", "3", "--input-len", "6", "--output-len", "2",
                "--goodput", "ttft:5000", "tpot:5000",
                "--random-prefix-len", "4",
                "--top-p", "0.9", "--top-k", "5", "--min-p", "0.1", "--num-warmups", "2",
                "--label", "mine", "--metadata", "gpu=none", "runs=1", "--trust-remote-code",
                "--save_result", "--ignore_eos", "--disable-tqdm"]  # fmt: skip
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        assert len(srv.bodies) == 2 + 3 and set(srv.models_asked) == {"served"}
        assert all(b["ignore_eos"] for b in srv.bodies) and not list(tmp_path.glob("--*"))
        prompts = [b["prompt"] for b in srv.bodies]
        assert all(isinstance(p, list) and len(p) == 4 + 6 for p in prompts)
        assert len({tuple(p[:4]) for p in prompts}) == 1 < len({tuple(p) for p in prompts})
        assert {(b["top_p"], b["top_k"], b["min_p"]) for b in srv.bodies} == {(0.9, 5, 0.1)}
        # (named, as vLLM names it, by --model: the checkpoint)
        (saved,) = tmp_path.glob(f"mine-infqps-{Path(str(tiny_checkpoint())).name}-*.json")
        result = json.loads(saved.read_text())
        assert result["model_id"] == str(tiny_checkpoint())
        assert (result["backend"], result["gpu"], result["runs"]) == ("vllm", "none", "1")
        assert result["completed"] == 3 and result["num_prompts"] == 3
        assert result["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 5000.0}
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--backend", "openai-chat"], "'openai-chat': tandem bench serve streams"),
        (["--metadata", "novalue"], "'novalue' is not KEY=VALUE"),
    ],
)
def test_vllm_options_it_cannot_honour_are_refused(
    server: FakeServer, extra: list[str], error: str
) -> None:
    args = ["bench", "serve", "--base-url", server.base_url, "--model", "fake", "--disable-tqdm"]
    res = CliRunner().invoke(app, [*args, *extra])
    assert res.exit_code == 2, res.output
    assert error in " ".join(res.output.replace("│", " ").split()), res.output


def test_the_server_root_from_vllms_host_and_port() -> None:
    from tandem.bench.serving.vllm_options import server_root

    assert server_root(None, None, None) == "http://127.0.0.1:8000"
    assert server_root(None, "::1", 9) == server_root(None, "[::1]", 9) == "http://[::1]:9"
    assert server_root("http://h:1", "x", 2) == "http://h:1"  # (--base-url wins, as vLLM's)
