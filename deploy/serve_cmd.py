"""`tandem serve`: start (or join) a Ray cluster, deploy the PD application, serve until Ctrl-C."""

from __future__ import annotations

import atexit
import logging
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer
from pydantic import ValidationError

from tandem.deploy.ingress import DEFAULT_INGRESS, STATE_DIR, Ingress, ingress_environment
from tandem.deploy.serve_guards import app_conflict, busy_ports, context_overrun, unreachable
from tandem.engine.errors import summarize_validation

logger = logging.getLogger("tandem.deploy")


def _config(
    config_file: Path | None,
    overrides: dict[str, Any],
    role_overrides: dict[str, int | None],
    nested: dict[tuple[str, str], Any] | None = None,
) -> Any:
    """The cluster config: the file's, then the flags that were given (`overrides` at the
    top level, replicas per role, `nested` as (section, field): value)."""
    from tandem.deploy.cluster_config import ClusterConfig, read_config_file

    data: dict[str, Any] = read_config_file(config_file) if config_file is not None else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    for role, replicas in role_overrides.items():
        if replicas is not None:
            data[role] = {**(data.get(role) or {}), "replicas": replicas}
    for (section, field), value in (nested or {}).items():
        if value is not None:
            data[section] = {**(data.get(section) or {}), field: value}
    return ClusterConfig.model_validate(data)


def _start_ray(
    address: str | None,
    host: str,
    num_cpus: float | None,
    dashboard_port: int,
    ingress: Ingress,
    needed: dict[str, float],
    ports: dict[str, int | None],
) -> Any:
    """Joins `address` (or a cluster already running here); otherwise starts a local one
    whose HTTP goes through `ingress`, once `ports` ({flag: port}) are free on `host`.
    `address="local"` always starts a new local cluster. A local cluster gets the CPUs and
    custom resources the deployment asks for (`needed`), at least one CPU per core: Ray's CPUs
    are a count for scheduling, not a limit. Exits with a one-line error when it cannot."""
    import ray

    if address and address != "local":
        _fail_if(unreachable(address, _dialed(address)))
        try:
            return ray.init(address=address), False
        except (ConnectionError, RuntimeError) as exc:
            _fail(f"cannot join the Ray cluster at {address}: {_first_line(exc)}")
    if address is None:
        try:
            ctx = ray.init(address="auto")
            typer.echo("[tandem] joined the Ray cluster running here: its Serve ingress is the one "
                       "it was started with (--ingress applies to clusters tandem starts)")  # fmt: skip
            return ctx, False
        except ConnectionError:
            pass
        except RuntimeError as exc:  # one is running, but refuses us (e.g. its auth token)
            _fail(
                f"cannot join the Ray cluster running here: {_first_line(exc)} (--address local "
                "starts a cluster of its own)"
            )
    _fail_if(busy_ports(host, ports))
    env = ingress_environment(ingress, os.environ)
    os.environ.update(env)
    if STATE_DIR in env:  # HAProxy's files, made for this cluster: removed when it stops
        atexit.register(shutil.rmtree, env[STATE_DIR], ignore_errors=True)
    cpus = num_cpus or max(os.cpu_count() or 1, math.ceil(needed.get("CPU", 0)))
    custom = {k: float(math.ceil(v)) for k, v in needed.items() if k not in ("CPU", "GPU")}
    ctx = ray.init(
        num_cpus=int(cpus),
        resources=custom or None,
        include_dashboard=True,
        dashboard_host=host,
        dashboard_port=dashboard_port,
    )
    return ctx, True


def _dialed(address: str) -> str | None:
    """The HOST:PORT Ray connects to for `address` (it swaps a loopback host for this
    machine's IP, where a cluster bound to 127.0.0.1 does not listen); None if unknown."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address)
    except Exception:  # a private helper: without it, the address as given
        return None


def _context_overrun(cfg: Any) -> str | None:
    """`context_overrun` for the roles `cfg` deploys, against its (resolved) model."""
    from tandem.engine.model_config import load_model_spec

    roles: tuple[Literal["prefill", "decode"], ...] = (
        ("decode",) if cfg.mode == "colocated" else ("prefill", "decode")
    )
    lens: dict[str, int | None] = {
        role: cfg.engine_config(role, cfg.model).max_model_len for role in roles
    }
    return context_overrun(lens, load_model_spec(cfg.model).context_length)


def _fail(error: str) -> NoReturn:
    """Exits with `error` (code 2)."""
    typer.echo(f"Error: {error}", err=True)
    raise typer.Exit(code=2)


def _fail_if(error: str | None) -> None:
    """Exits with `error` (code 2) unless it is None."""
    if error is not None:
        _fail(error)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _refuse_running_app(app_name: str, ctx: Any) -> None:
    """Exits when the joined cluster already runs `app_name` (before anything is deployed or
    shut down: Ray is left as it was)."""
    import ray
    from ray import serve as ray_serve

    running = {
        name: str(getattr(app.status, "value", app.status))
        for name, app in ray_serve.status().applications.items()
    }
    address = getattr(ctx, "address_info", {}).get("gcs_address", "here")
    error = app_conflict(app_name, address, running)
    if error is not None:
        ray.shutdown()
        _fail_if(error)


def serve(
    model: Annotated[
        Path | None,
        typer.Option(help="Local Hugging Face checkpoint (default: the embedded tiny model)."),
    ] = None,
    prefill_replicas: Annotated[
        int | None, typer.Option(min=1, help="Prefill workers (default 1).")
    ] = None,
    decode_replicas: Annotated[
        int | None, typer.Option(min=1, help="Decode workers (default 1).")
    ] = None,
    transport: Annotated[
        str | None, typer.Option(help="KV transport: shm (default), torch or ucx.")
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            help="pd (default): prefill and decode workers. colocated: no prefill workers, "
            "each decode worker prefills its own requests (a baseline to compare PD with)."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port of the OpenAI API (8000).")] = None,
    grpc_port: Annotated[
        int | None, typer.Option(help="gRPC port (50051); 0 turns gRPC off.")
    ] = None,
    direct_port: Annotated[
        int | None,
        typer.Option(
            help="Port on which the router serves the OpenAI API itself, skipping Serve's "
            "proxy: lower latency (8001); 0 turns it off."
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            exists=True, dir_okay=False, help="Cluster config YAML/JSON; flags override it."
        ),
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(
            help="Ray cluster to join (HOST:PORT). Default: one running on this machine, else a "
            "new local one; 'local' always starts a new local cluster."
        ),
    ] = None,
    num_cpus: Annotated[
        float | None,
        typer.Option(
            min=1,
            help="CPUs of a newly started local Ray cluster (default: what the replicas ask "
            "for, at least one per core).",
        ),
    ] = None,
    dashboard_port: Annotated[int, typer.Option(help="Ray dashboard port (new cluster).")] = 8265,
    ingress: Annotated[
        Ingress,
        typer.Option(
            help="HTTP front of a cluster tandem starts: proxy (default), Ray Serve's Python proxy "
            "actor, relays every request and SSE chunk; haproxy, Ray's HAProxy ingress, forwards "
            "straight to the router replicas (about 7 ms less time to first token here), and a "
            "stream that waits then writes ': keep-alive' SSE comments every 0.25 s, so that a "
            "client's leaving is noticed (clients that parse every line as JSON fail on them).",
            case_sensitive=False,
        ),
    ] = DEFAULT_INGRESS,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="Model name clients send (default: the checkpoint folder's name)."),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(min=2, help="Longest prompt + output in tokens (default: the model's)."),
    ] = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(
            min=0.01,
            max=1.0,
            help="Share of a GPU's memory each engine on it may use for weights, activations "
            "and its KV cache (default 0.9; on a share of a GPU, 0.9 x that share). CPU "
            "engines size their KV cache by engine.kv_cache_memory_gb (1 GiB).",
        ),
    ] = None,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            help="How the model writes tool calls (tool_choice auto): hermes, llama3_json, "
            "mistral, or auto (default): the one its chat template teaches."
        ),
    ] = None,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            help="qwen3 or deepseek_r1: a chat reply's <think>...</think> goes to "
            "reasoning_content, apart from its content (default: left in the content)."
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            help="Jinja chat template for the chat API instead of the checkpoint's: a file's "
            "path, or the template's text."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TANDEM_API_KEY",
            help="Require 'Authorization: Bearer <key>' on the API (HTTP and gRPC); /health "
            "and /metrics stay open.",
        ),
    ] = None,
) -> None:
    """Serve a model with disaggregated prefill and decode on Ray (OpenAI API + gRPC).

    Starts a local Ray cluster with the dashboard when none is running, deploys a router, the
    prefill workers and the decode workers, prints the URLs, and stops cleanly on Ctrl-C.
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    overrides = {
        "model": str(model) if model else None,
        "transport": transport,
        "mode": mode,
        "host": host,
        "port": port,
        "grpc_port": grpc_port,
        "direct_port": direct_port,
        "api_key": api_key,
        "chat_template": chat_template,
        "served_model_name": served_model_name,
        "cache_dir": os.environ.get("TANDEM_CACHE_DIR"),
    }
    try:
        roles = {"prefill": prefill_replicas, "decode": decode_replicas}
        nested = {
            ("engine", "max_model_len"): max_model_len,
            ("engine", "gpu_memory_utilization"): gpu_memory_utilization,
            ("router", "tool_call_parser"): tool_call_parser,
            ("router", "reasoning_parser"): reasoning_parser,
        }
        cfg = _config(config, overrides, roles, nested)
        if cfg.mode == "colocated" and prefill_replicas is not None:
            typer.echo("[tandem] note: --prefill-replicas is ignored in colocated mode (the "
                       "decode workers prefill every request themselves)", err=True)  # fmt: skip
        from tandem.deploy.app_builder import build_app, registry_name, resolve_model

        typer.echo("[tandem] preparing the model ...")
        cfg = cfg.model_copy(update={"model": resolve_model(cfg)})
        _fail_if(_context_overrun(cfg))
        app = build_app(cfg)
    except ValidationError as exc:
        typer.echo(f"Error: invalid configuration: {summarize_validation(exc)}", err=True)
        raise typer.Exit(code=2) from None
    except (ValueError, OSError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if cfg.host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    started = time.monotonic()
    from ray import serve as ray_serve

    needed = cfg.ray_resources_needed()
    ports = {"--port": cfg.port, "--grpc-port": cfg.grpc_port, "--direct-port": cfg.direct_port}
    ctx, own_cluster = _start_ray(
        address, cfg.host, num_cpus, dashboard_port, ingress, needed, ports
    )
    if not own_cluster:
        _refuse_running_app(cfg.app_name, ctx)
    _warn_if_short(needed)
    stop = threading.Event()

    def on_signal(*_: Any) -> None:
        if stop.is_set():  # a second Ctrl-C: no more waiting for the drain
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        ray_serve.start(http_options={"host": cfg.host, "port": cfg.port})
        ray_serve.run(app, name=cfg.app_name, route_prefix="/")
        _print_urls(cfg, ctx, time.monotonic() - started, ingress if own_cluster else None)
        while not stop.wait(0.5):
            pass
        drain_s = max(cfg.decode.drain_timeout_s, cfg.prefill.drain_timeout_s)
        typer.echo(f"[tandem] stopping: in-flight requests finish first (at most {drain_s:g}s; "
                   "Ctrl-C again to stop at once) ...")  # fmt: skip
    finally:
        _shutdown(cfg.app_name, registry_name(cfg))
    typer.echo("[tandem] stopped")


def resource_shortfall(needed: dict[str, float], total: dict[str, float]) -> dict[str, float]:
    """What of `needed` a cluster with `total` resources lacks: {resource: missing amount}."""
    return {
        name: round(amount - total.get(name, 0.0), 6)
        for name, amount in needed.items()
        if total.get(name, 0.0) + 1e-9 < amount
    }


def _warn_if_short(needed: dict[str, float]) -> None:
    """Says so when the cluster lacks resources the deployment asks for: Serve would wait for
    them without a word beyond its own log (an autoscaling cluster may still add them)."""
    import ray

    total = {k: float(v) for k, v in ray.cluster_resources().items()}
    missing = resource_shortfall(needed, total)
    if missing:
        asks = ", ".join(f"{k} {needed[k]:g} (has {total.get(k, 0):g})" for k in sorted(missing))
        typer.echo(
            f"[tandem] warning: the deployment asks for {asks}; replicas that do not fit wait "
            "until the cluster has room (lower num_cpus / num_gpus / resources per role, or "
            "--num-cpus for a cluster tandem starts)",
            err=True,
        )


def _print_urls(cfg: Any, ctx: Any, seconds: float, ingress: Ingress | None) -> None:
    """`ingress`: what the cluster tandem started uses (None: a cluster it joined)."""
    host = cfg.host if cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
    dashboard = getattr(ctx, "dashboard_url", None)
    workers = (
        f"{cfg.decode.replicas} colocated workers (prefill + decode)"
        if cfg.mode == "colocated"
        else f"{cfg.prefill.replicas} prefill + {cfg.decode.replicas} decode workers, "
        f"{cfg.transport} KV transport"
    )
    lines = [
        f"[tandem] serving {cfg.served_model_name or Path(cfg.model).name}: {workers}, "
        f"ready in {seconds:.1f}s",
        f"[tandem]   OpenAI API:    http://{host}:{cfg.port}/v1"
        + (f" (through {ingress.value})" if ingress else "")
        + (" (API key required: 'Authorization: Bearer <key>')" if cfg.api_key else ""),
    ]
    if cfg.direct_port:
        lines.append(
            f"[tandem]   OpenAI API:    http://{host}:{cfg.direct_port}/v1 (the router's own "
            "port: lower latency)"
        )
    if cfg.grpc_port:
        lines.append(f"[tandem]   gRPC:          {host}:{cfg.grpc_port} (tandem.v1.Generation)")
    lines.append(f"[tandem]   Metrics:       http://{host}:{cfg.port}/metrics (Prometheus)")
    if dashboard:
        lines.append(f"[tandem]   Ray dashboard: http://{dashboard}")
    lines.append(
        "[tandem]   Grafana:       deploy/dashboards/*.json (import; see docs/observability.md)"
    )
    lines.append("[tandem] press Ctrl-C to stop")
    typer.echo("\n".join(lines))


def _shutdown(app_name: str, registry: str) -> None:
    import ray
    from ray import serve as ray_serve

    from tandem.engine.worker_registry import kill_registry

    try:
        # Deleting the app first drains it (the router and the workers wait for the requests,
        # streams and KV transfers in flight); Serve's own shutdown would stop its proxy first
        # and cut every stream.
        ray_serve.delete(app_name)
        kill_registry(registry)
        # Serve's controller and proxies go with a cluster this command started (`ray.shutdown`
        # below tears it down); `serve.shutdown()` would only add a warning, as it kills its
        # controller mid-call. On a cluster it joined, Serve stays for its other apps.
    except Exception as exc:  # shutting down anyway: say what failed
        logger.warning("clean shutdown incomplete: %s", exc)
    finally:
        ray.shutdown()
