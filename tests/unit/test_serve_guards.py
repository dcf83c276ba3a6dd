"""`tandem serve`'s checks before it starts or joins a Ray cluster: a second server on the
machine fails with one line instead of sharing the first one's ports (Serve's proxy and gRPC
set SO_REUSEPORT, so a second cluster's bind succeeded and split the traffic) or replacing
and then deleting its application."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.deploy.cli import app
from tandem.deploy.serve_guards import (
    app_conflict,
    busy_ports,
    context_overrun,
    port_conflicts,
    port_in_use,
    unreachable,
)


@pytest.fixture
def reuseport_listener() -> Iterator[int]:
    """A listener that set SO_REUSEPORT, as Ray Serve's proxy does: its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port bound on every interface but not listening, for the test's length: connecting
    to it is refused, and no other process can take it meanwhile (a port merely found free
    could be, in a busy test run)."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        yield int(sock.getsockname()[1])


def test_a_port_held_with_so_reuseport_is_in_use(reuseport_listener: int) -> None:
    port = reuseport_listener
    assert port_in_use("127.0.0.1", port) is True
    assert busy_ports("127.0.0.1", {"--port": port, "--grpc-port": 0}) == (
        f"port {port} (--port) is already in use on 127.0.0.1 (another `tandem serve`, or "
        "another server): stop it, or give this one other ports"
    )
    assert busy_ports("127.0.0.1", {"--port": port, "--grpc-port": port}) == (
        f"ports {port} (--port) and {port} (--grpc-port) are already in use on 127.0.0.1 "
        "(another `tandem serve`, or another server): stop it, or give this one other ports"
    )


def test_free_ports_pass() -> None:
    port = _closed_port()
    assert port_in_use("127.0.0.1", port) is False
    assert busy_ports("127.0.0.1", {"--port": port, "--grpc-port": None}) is None


def test_a_running_application_of_the_same_name_is_refused() -> None:
    assert app_conflict("tandem", "10.0.0.1:6379", {"tandem": "RUNNING"}) == (
        "the Ray cluster at 10.0.0.1:6379 already runs the Serve application 'tandem' "
        "(RUNNING), most likely another `tandem serve`: serving here would replace it, and "
        "stopping would delete it. Stop that one first, or start a cluster of your own with "
        "--address local and other --port / --grpc-port / --dashboard-port (`serve deploy` "
        "upgrades a running application on purpose)"
    )
    assert app_conflict("tandem", "x", {"bench": "RUNNING"}) is None
    assert app_conflict("tandem", "x", {"tandem": "DELETING"}) is None


def test_an_unreachable_address_is_named(refused_port: int) -> None:
    port = refused_port
    assert unreachable(f"127.0.0.1:{port}") == (
        f"cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused"
    )
    assert unreachable(f"localhost:{port}", f"127.0.0.1:{port}") == (
        f"cannot reach the Ray cluster at localhost:{port} (Ray dials it as 127.0.0.1:{port}): "
        "Connection refused"
    )
    assert unreachable("auto") is None
    assert unreachable("ray://head:10001") is None
    for bad in ("nohost", "bogus:xx", ":6379", "head:0"):
        assert unreachable(bad) == (
            f"the Ray cluster address {bad!r} is not HOST:PORT (its GCS, e.g. 10.0.0.5:6379), "
            "auto, local or ray://HOST:PORT"
        )


def test_ports_that_clash_or_that_ray_takes_are_named() -> None:
    assert port_conflicts({"--port": 8000, "--grpc-port": None, "--dashboard-port": 8265}) is None
    assert port_conflicts({"--port": 8000, "--direct-port": 0, "--dashboard-port": 8000}) == (
        "--dashboard-port and --port are both 8000: each server needs a port of its own"
    )
    assert port_conflicts({"--port": 6379}) == (
        "port 6379 (--port) is taken by Ray for its GCS: pick another"
    )
    assert port_conflicts({"--port": 8000, "--grpc-port": 12345}) == (
        "port 12345 (--grpc-port) is taken by Ray for its workers (ports 10002-19999): pick another"
    )


def _serve(checkpoint: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["serve", "--model", str(checkpoint), *args])
    return result.exit_code, result.output


def test_serve_refuses_an_unreachable_address_in_one_line(
    tiny_checkpoint: Callable[..., Path], refused_port: int
) -> None:
    port = refused_port
    code, out = _serve(tiny_checkpoint(), "--address", f"127.0.0.1:{port}")
    assert code == 2
    # (Ray dials a loopback address as this machine's IP, which the message names)
    assert re.fullmatch(
        rf"Error: cannot reach the Ray cluster at 127\.0\.0\.1:{port}"
        rf"( \(Ray dials it as [0-9a-f.:]+:{port}\))?: Connection refused",
        out.splitlines()[-1],
    ), out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--address", "bogus:xx"],
            "Error: the Ray cluster address 'bogus:xx' is not HOST:PORT (its GCS, e.g. "
            "10.0.0.5:6379), auto, local or ray://HOST:PORT",
        ),
        (
            ["--address", "local", "--dashboard-port", "8000", "--port", "8000"],
            "Error: --dashboard-port and --port are both 8000: each server needs a port of its own",
        ),
    ],
)
def test_serve_refuses_a_bad_address_or_port_in_one_line(
    tiny_checkpoint: Callable[..., Path], args: list[str], error: str
) -> None:
    code, out = _serve(tiny_checkpoint(), *args)
    assert code == 2 and "Traceback" not in out, out
    assert out.splitlines()[-1] == error


def test_the_dashboard_port_is_a_port(tiny_checkpoint: Callable[..., Path]) -> None:
    code, out = _serve(tiny_checkpoint(), "--dashboard-port", "99999")
    assert code == 2 and "'--dashboard-port': Input should be less than or equal to 65535" in out


@pytest.mark.parametrize("flag", ["--port", "--direct-port"])
def test_serve_refuses_a_port_in_use_before_starting_ray(
    tiny_checkpoint: Callable[..., Path], reuseport_listener: int, flag: str
) -> None:
    """Serve's proxy and the routers' own HTTP port both bind with SO_REUSEPORT: a second
    server would share the port, so a port in use is refused."""
    port = reuseport_listener
    # (a free dashboard port: the default one is held while any other Ray cluster runs here)
    dashboard = ["--dashboard-port", str(_closed_port())]
    code, out = _serve(tiny_checkpoint(), "--address", "local", flag, str(port), *dashboard)
    assert code == 2
    assert out.splitlines()[-1] == (
        f"Error: port {port} ({flag}) is already in use on 127.0.0.1 (another `tandem serve`, "
        "or another server): stop it, or give this one other ports"
    )


def test_max_model_len_over_the_context_is_refused() -> None:
    assert context_overrun({"prefill": 4096, "decode": None}, 2048) == (
        "max_model_len 4096 (prefill) exceeds the model's context of 2048 tokens "
        "(max_position_embeddings in its config.json, times a linear or yarn rope scaling "
        "factor): lower --max-model-len or engine.max_model_len"
    )
    assert context_overrun({"prefill": 2048, "decode": None}, 2048) is None


def test_serve_refuses_max_model_len_over_the_context_before_starting_ray(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    code, out = _serve(tiny_checkpoint(), "--address", "local", "--max-model-len", "100000")
    assert code == 2
    assert out.splitlines()[-1] == (
        "Error: max_model_len 100000 (prefill), 100000 (decode) exceeds the model's context of "
        "2048 tokens (max_position_embeddings in its config.json, times a linear or yarn rope "
        "scaling factor): lower --max-model-len or engine.max_model_len"
    )


def test_serve_names_a_cluster_that_refuses_it(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cluster running here that refuses the connection (e.g. another auth token): Ray's
    # RuntimeError came out as a traceback
    import ray

    def refuse(**_: object) -> None:
        raise RuntimeError("Failed to connect to GCS. Last connection error: Traceback ...\nmore")

    monkeypatch.setattr(ray, "init", refuse)
    code, out = _serve(tiny_checkpoint())
    assert code == 2
    assert out.splitlines()[-1] == (
        "Error: cannot join the Ray cluster running here: Failed to connect to GCS. Last "
        "connection error: Traceback ... (--address local starts a cluster of its own)"
    )


def test_serve_takes_vllm_s_dtype_spellings_and_refuses_others_before_starting_ray(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    from tandem.deploy.cluster_config_flags import cluster_config_from as _config

    path = str(tiny_checkpoint())
    for given, dtype in (("half", "float16"), ("bf16", "bfloat16"), ("float32", "float32")):
        cfg = _config(None, {"model": path}, {}, {("engine", "dtype"): given})
        assert {cfg.engine_config(role, path).dtype for role in ("prefill", "decode")} == {dtype}
    assert _config(None, {"model": path}, {}, {}).engine_config("decode", path).dtype == "float32"
    code, out = _serve(tiny_checkpoint(), "--address", "local", "--dtype", "float64")
    assert code == 2
    assert out.splitlines()[-1] == (
        "Error: engine settings (shared): dtype 'float64' is not one of auto, float32, "
        "bfloat16, float16, float, half, bf16, fp16"
    )


def test_joining_a_cluster_here_refuses_a_router_port_in_use(
    tiny_checkpoint: Callable[..., Path],
    reuseport_listener: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Joined, the router still opens its own ports here: one held by another server was
    advertised in the banner (it answered the other server's 404s) and only logged."""
    import ray

    import tandem.deploy.serve_cmd as serve_cmd

    monkeypatch.setattr(ray, "init", lambda **_: object())  # (a cluster running here)
    monkeypatch.setattr(serve_cmd, "refuse_running_app", lambda *_: None)
    port = reuseport_listener
    code, out = _serve(tiny_checkpoint(), "--direct-port", str(port))
    assert code == 2
    assert f"Error: port {port} (--direct-port) is already in use" in out.splitlines()[-1]


def test_an_error_ray_carried_out_of_an_actor_says_what_went_wrong() -> None:
    from tandem.deploy.serve_guards import error_line

    carried = RuntimeError(
        "ray::ProxyActor.ready() (pid=12, ip=10.0.0.1, actor_id=ab, repr=<ProxyActor>)\n"
        '  File "x.py", line 3, in ready\n'
        "RuntimeError: Failed to bind to address '127.0.0.1:8000'.\n"
    )
    assert error_line(carried) == (
        "ray::ProxyActor.ready(): RuntimeError: Failed to bind to address '127.0.0.1:8000'."
    )
    assert error_line(RuntimeError("one line\nmore")) == "one line"
