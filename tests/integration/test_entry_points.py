"""`tandem serve` and `serve run <committed Serve config>` each start the app on a fresh Ray.

Each runs as a subprocess with its own Ray temp dir, so it starts its own cluster instead of
joining the one the other integration tests share.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import yaml

from tandem.deploy.ingress import DEFAULT_INGRESS
from tests.integration.conftest import free_port, wait_ready

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture()
def isolated_env() -> Iterator[dict[str, str]]:
    tmp = tempfile.mkdtemp(prefix="tdm", dir="/tmp")  # short: Ray's socket paths must fit
    env = {
        **os.environ,
        "RAY_TMPDIR": tmp,
        "TANDEM_CACHE_DIR": f"{tmp}/cache",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",  # its own lines in order with Ray's, should it fail to stop
    }
    env.pop("RAY_ADDRESS", None)
    yield env
    shutil.rmtree(tmp, ignore_errors=True)


# The `serve` console script, plus a stack dump of every thread on SIGUSR1. Ctrl-C is given
# Python's own handler: a process started in the background by a shell without job control (a
# CI runner, `cmd &`) inherits SIGINT ignored, and Python then leaves it ignored.
SERVE_CLI = (
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from ray.serve.scripts import cli; sys.argv[0] = 'serve'; sys.exit(cli())"
)


class Output:
    """A process's output, read as it comes (so that a test can wait for a line)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} in {timeout}s:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def stop(self, timeout: float = 60) -> str:
        """Ctrl-C, and all the output once the process has stopped (AssertionError if it
        does not in `timeout` s)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.reader.join(10)
            raise AssertionError(
                f"did not stop on SIGINT within {timeout}s:\n{self.text()[-3000:]}"
            ) from None
        self.reader.join(10)
        return self.text()


def stop_ray_serve_run(proc: subprocess.Popen[str]) -> None:
    """Stop Ray's `serve run` as a user would: Ctrl-C, again after 30 s, a stack dump of every
    thread (SIGUSR1), then `kill` (its SIGTERM handler exits too); then SIGKILL to its process
    group (the Ray cluster it started).

    Ray's CLI, not ours, decides how Ctrl-C is handled; it stops in ~5 s here (it went on for
    90 s when it inherited SIGINT ignored, see `SERVE_CLI`), so a hang warns with its output
    (and the stacks) instead of failing: `tandem serve`'s own Ctrl-C is held to account in the
    test above."""
    steps = [(signal.SIGINT, 30.0), (signal.SIGINT, 30.0), (signal.SIGUSR1, 2.0),
             (signal.SIGTERM, 30.0)]  # fmt: skip
    stopped_by: int | None = None  # the step that stopped it
    for step, (sig, wait_s) in enumerate(steps):
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=wait_s)  # (reads on: a full pipe would block its logger)
            stopped_by = step
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # Ray made the driver its group's leader
    out, _ = proc.communicate(timeout=30)  # (all of it: communicate keeps what it read so far)
    if stopped_by != 0:
        how = (
            "SIGKILL"
            if stopped_by is None
            else f"{steps[stopped_by][0].name} (step {stopped_by + 1})"
        )
        warnings.warn(f"`serve run` went on after Ctrl-C; stopped by {how}:\n{out[-8000:]}",
                      stacklevel=1)  # fmt: skip


def streams_started(port: int, model: str, count: int, max_tokens: int) -> list[Any]:
    """`count` streaming completions under way (each has its first chunk): futures of
    (tokens streamed, finish reason)."""
    started = threading.Barrier(count + 1, timeout=60)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

    def run() -> tuple[int, str | None]:
        stream = c.completions.create(
            model=model, prompt="drain", max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )  # fmt: skip
        finish, tokens, first = None, 0, True
        for chunk in stream:
            if first:
                first = False
                started.wait()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return tokens, finish

    pool = ThreadPoolExecutor(count)
    futures = [pool.submit(run) for _ in range(count)]
    started.wait()
    pool.shutdown(wait=False)
    return futures


def new_requests_while(
    streaming: list[Future[Any]], ports: tuple[int, ...]
) -> list[tuple[int, int, str | None]]:
    """(port, status, error code or health status) of a new completion and a `/health` on each
    of `ports`, every 0.1 s until the `streaming` requests have ended.

    The server stops as soon as the streams have been sent to the end, which may be before this
    client has read their last bytes: a connection the server closed ends the probing, once the
    streams have ended too (the caller checks that each was whole)."""
    answers: list[tuple[int, int, str | None]] = []
    with requests.Session() as client:
        while not all(future.done() for future in streaming):
            try:
                for port in ports:
                    url = f"http://127.0.0.1:{port}"
                    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}
                    done = client.post(f"{url}/v1/completions", json=body, timeout=30)
                    code = done.json()["error"]["code"] if done.status_code != 200 else None
                    answers.append((port, done.status_code, code))
                    health = client.get(f"{url}/health", timeout=30)
                    answers.append((port, health.status_code, health.json()["status"]))
            except requests.ConnectionError as closed:
                # (the server stops once it has sent the streams: this client reads their ends soon)
                still = wait(streaming, timeout=10).not_done
                assert not still, f"a connection closed while {len(still)} streams ran: {closed}"
                break
            time.sleep(0.1)
    return answers


def complete(port: int, model: str) -> str:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    out = c.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 5
    return out.choices[0].text


def bench(port: int, env: dict[str, str], result: Path) -> dict[str, Any]:
    """`tandem bench serve` against the server: a handful of streamed multi-turn requests."""
    args = [str(BIN / "tandem"), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
            "--model", "tiny-llama", "--dataset-name", "multi-turn", "--num-prompts", "6",
            "--mt-num-turns", "3", "--mt-first-len", "20", "--mt-turn-len", "5",
            "--mt-output-len", "6", "--request-rate", "20", "--goodput", "ttft:60000",
            "--save-result", str(result), "--save-detailed", "--disable-tqdm"]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def test_tandem_serve_answers_and_stops_on_ctrl_c(
    isolated_env: dict[str, str], tmp_path: Path
) -> None:
    port, grpc_port, direct_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [str(BIN / "tandem"), "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--direct-port", str(direct_port),
         "--dashboard-port", str(free_port()), "--num-cpus", "2", "--address", "local"],
        env=isolated_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    said = Output(proc)
    try:
        # (Serve answers before `tandem serve` prints its banner: a Ctrl-C before it is a stop
        # while starting, which drains too but says less)
        said.wait_for(", ready in ", timeout=180)
        wait_ready(f"http://127.0.0.1:{port}", timeout=30)
        text = complete(port, "tiny-llama")
        wait_ready(f"http://127.0.0.1:{direct_port}", timeout=90)
        assert complete(direct_port, "tiny-llama") == text  # the router's own port
        result = bench(port, isolated_env, tmp_path / "bench.json")
        streaming = streams_started(port, "tiny-llama", count=3, max_tokens=1500)
    except BaseException:
        print(said.stop()[-5000:])  # what `tandem serve` said, in the test report
        raise
    with ThreadPoolExecutor(1) as pool:  # (Ctrl-C while the streams run: they finish first)
        probed = pool.submit(new_requests_while, streaming, (port, direct_port))
        out = said.stop(timeout=120)
        answers = probed.result(timeout=10)
    assert proc.returncode == 0, out[-3000:]
    ended = [future.result(timeout=10) for future in streaming]
    assert ended == [(1500, "length")] * 3, ended
    # Meanwhile a new request got its answer or a 503 that says why, on either port (Serve's
    # proxy answered 404 text/plain); here the streams outlast the stop's first second, so the
    # 503s show (a much faster machine may finish them first: then only 200s).
    refused = {a for a in answers if a[1] != 200}
    assert answers and refused <= {
        (p, 503, why) for p in (port, direct_port) for why in ("shutting_down", "stopping")
    }, answers
    assert "new requests get a 503 while those in flight finish" in out
    assert f"OpenAI API:    http://127.0.0.1:{port}/v1 (through {DEFAULT_INGRESS})" in out
    assert f"OpenAI API:    http://127.0.0.1:{direct_port}/v1 (the router's own port" in out
    assert "Ray dashboard: http://" in out
    assert "/metrics (Prometheus)" in out
    assert "[tandem] stopped" in out
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 36)
    assert result["request_goodput"] == result["request_throughput"] > 0
    assert all(ttft > 0 for ttft in result["ttfts"])
    assert any(result["itls"])  # (a fast tiny model may stream a request's tokens in one chunk)
    # The server's prompt_tokens, in send order (2 conversations x 3 turns, interleaved):
    # each later turn carries the history (previous prompt + 6-token answer + 5 new tokens).
    lens = sorted(result["input_lens"])
    assert lens[1] < lens[2] and lens[3] < lens[4], result["input_lens"]


def test_a_ctrl_c_while_it_starts_lets_the_streams_in_flight_finish(
    isolated_env: dict[str, str],
) -> None:
    """Serve answers before `tandem serve` has printed its banner (it still waits for Serve
    to say the app runs): a Ctrl-C then stops it while starting, and the streams it already
    serves finish first. (On a machine where the banner comes first, this is the plain stop.)"""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "tandem"), "serve", "--port", str(port), "--grpc-port", str(free_port()),
         "--direct-port", str(free_port()), "--dashboard-port", str(free_port()),
         "--num-cpus", "2", "--address", "local"],
        env=isolated_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    said = Output(proc)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=180)
        streaming = streams_started(port, "tiny-llama", count=2, max_tokens=400)
    except BaseException:
        print(said.stop()[-5000:])
        raise
    out = said.stop(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    ended = [future.result(timeout=30) for future in streaming]
    assert ended == [(400, "length")] * 2, (ended, out[-3000:])
    if "interrupted while starting" in out:
        assert "new requests get a 503 while those in flight finish" in out
    assert "[tandem] stopped" in out


def test_serve_run_on_the_committed_config(isolated_env: dict[str, str], tmp_path: Path) -> None:
    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port  # only ports and the model cache move
    args = config["applications"][0]["args"]
    args["grpc_port"], args["direct_port"] = free_port(), free_port()
    args["cache_dir"] = isolated_env["TANDEM_CACHE_DIR"]
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_CLI, "run", str(path)],
        env=isolated_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=180)
        complete(port, "tiny-llama")
    finally:
        stop_ray_serve_run(proc)


def test_tandem_serve_refuses_gpus_its_own_cluster_cannot_have(
    isolated_env: dict[str, str], tmp_path: Path
) -> None:
    """The local cluster `tandem serve` starts never grows: a role asking for a GPU on a
    machine with none is a one-line error and an exit, not a wait that never ends."""
    config = tmp_path / "gpu.yaml"
    config.write_text("prefill:\n  num_gpus: 1\n")
    isolated_env = {**isolated_env, "CUDA_VISIBLE_DEVICES": ""}
    args = [str(BIN / "tandem"), "serve", "--config", str(config), "--port", str(free_port()),
            "--direct-port", "0", "--grpc-port", str(free_port()), "--dashboard-port",
            str(free_port()), "--num-cpus", "2", "--address", "local"]  # fmt: skip
    done = subprocess.run(args, env=isolated_env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "GPU 1 (has 0)" in error[0], done.stderr
    assert "Traceback" not in done.stderr
