"""Checks `tandem serve` makes before it starts or joins a Ray cluster, so that a second server
on the same machine fails with one line instead of sharing ports or replacing the first one
(and a deployment that could never start is refused before Ray starts); `fail` / `fail_if`
end the command with such a line."""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

import typer

from tandem.engine.model_config import CONTEXT_SOURCE

# Serve application states in which the application is gone or going.
_GONE_STATES = frozenset({"DELETING", "NOT_STARTED"})


def port_in_use(host: str, port: int) -> bool:
    """Whether a server listens on `host`:`port`. A plain bind (no SO_REUSEPORT) is refused
    also by a listener that set SO_REUSEPORT, as Ray Serve's proxy and gRPC servers do: those
    would otherwise share the port with a second cluster and split its traffic silently."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False  # an unresolvable host fails later, with Ray's own message
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def busy_ports(host: str, ports: Mapping[str, int | None]) -> str | None:
    """One line naming the ports of `ports` ({flag: port}; None or 0: unused) that a server
    on `host` holds already, or None when all are free."""
    busy = [f"{port} ({flag})" for flag, port in ports.items() if port and port_in_use(host, port)]
    if not busy:
        return None
    held = f"port {busy[0]} is" if len(busy) == 1 else f"ports {' and '.join(busy)} are"
    return (
        f"{held} already in use on {host} (another `tandem serve`, or another server): stop "
        "it, or give this one other ports"
    )


RAY_PORTS = {6379: "its GCS", 10001: "the Ray Client server"}
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default min/max_worker_port


def port_conflicts(ports: Mapping[str, int | None]) -> str | None:
    """One line when two of `ports` ({flag: port}; None or 0: unused) are the same port, or
    one is a port a new local Ray cluster takes for itself; None when they are fine."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in seen:
            return f"{flag} and {seen[port]} are both {port}: each server needs a port of its own"
        seen[port] = flag
        owner = RAY_PORTS.get(port)
        if owner is None and port in RAY_WORKER_PORTS:
            owner = "its workers (ports 10002-19999)"
        if owner is not None:
            return f"port {port} ({flag}) is taken by Ray for {owner}: pick another"
    return None


def app_conflict(app_name: str, address: str, applications: Mapping[str, str]) -> str | None:
    """One line when the cluster at `address` already runs a Serve application `app_name`
    (`applications`: {name: status}): deploying would replace it, and stopping this command
    would delete it. None when the name is free."""
    status = applications.get(app_name)
    if status is None or status in _GONE_STATES:
        return None
    return (
        f"the Ray cluster at {address} already runs the Serve application '{app_name}' "
        f"({status}), most likely another `tandem serve`: serving here would replace it, and "
        "stopping would delete it. Stop that one first, or start a cluster of your own with "
        "--address local and other --port / --grpc-port / --dashboard-port (`serve deploy` "
        "upgrades a running application on purpose)"
    )


def unreachable(address: str, dialed: str | None = None, timeout_s: float = 5.0) -> str | None:
    """Why a Ray cluster at `address` (HOST:PORT, the GCS) cannot be reached, or None when it
        answers or the address is another form (`auto`, `ray://...`); also when it is no address at
    all (`nohost`, `host:xx`). `dialed`: the HOST:PORT Ray
        will connect to for it (Ray swaps a loopback host for the machine's IP), if another. Ray
        itself would retry for minutes and end in a traceback."""
    if address == "auto" or "://" in address:
        return None
    target = dialed or address
    host, sep, port = target.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        return (
            f"the Ray cluster address {address!r} is not HOST:PORT (its GCS, e.g. "
            "10.0.0.5:6379), auto, local or ray://HOST:PORT"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        via = f" (Ray dials it as {target})" if target != address else ""
        return f"cannot reach the Ray cluster at {address}{via}: {reason}"
    return None


def context_overrun(max_model_lens: Mapping[str, int | None], context: int) -> str | None:
    """One line when a role's `max_model_len` ({role: tokens}; None: the model's) exceeds the
    model's `context`: each worker would fail to start, and Serve would retry it for good."""
    over = {role: n for role, n in max_model_lens.items() if n is not None and n > context}
    if not over:
        return None
    lengths = ", ".join(f"{n} ({role})" for role, n in over.items())
    return (
        f"max_model_len {lengths} exceeds the model's context of {context} tokens "
        f"({CONTEXT_SOURCE}): lower --max-model-len or engine.max_model_len"
    )


def context_overrun_of(cfg: Any) -> str | None:
    """`context_overrun` for the roles `cfg` deploys, against its (resolved) model."""
    from tandem.engine.model_config import load_model_spec

    roles: tuple[Literal["prefill", "decode"], ...] = (
        ("decode",) if cfg.mode == "colocated" else ("prefill", "decode")
    )
    lens: dict[str, int | None] = {
        role: cfg.engine_config(role, cfg.model).max_model_len for role in roles
    }
    return context_overrun(lens, load_model_spec(cfg.model).context_length)


def dialed(address: str) -> str | None:
    """The HOST:PORT Ray connects to for `address` (it swaps a loopback host for this
    machine's IP, where a cluster bound to 127.0.0.1 does not listen); None if unknown."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address)
    except Exception:  # a private helper: without it, the address as given
        return None


def fail(error: str) -> NoReturn:
    """Exits with `error` (code 2)."""
    typer.echo(f"Error: {error}", err=True)
    raise typer.Exit(code=2)


def fail_if(error: str | None) -> None:
    """Exits with `error` (code 2) unless it is None."""
    if error is not None:
        fail(error)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def error_line(exc: BaseException) -> str:
    """The line that says what went wrong: the first, or for an error Ray carried out of an
    actor or task (its first line names the call, `ray::ProxyActor.ready() (pid=...)`) the
    last, the original error's (`RuntimeError: Failed to bind to address ...`)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("ray::"):
        return f"{lines[0].split(' (', 1)[0]}: {lines[-1]}"
    return first_line(exc)
