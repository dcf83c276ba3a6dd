"""`tandem serve`: start (or join) a Ray cluster, deploy the PD application, serve until Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from tandem.deploy import serve_engine_flags as flags
from tandem.deploy import serve_vllm_flags as vllm_flags
from tandem.deploy.cluster_config_flags import cluster_config_from
from tandem.deploy.ingress import DEFAULT_INGRESS, Ingress
from tandem.deploy.ray_cluster import (
    call_off_stop,
    cluster_gone,
    drains_when_stopped_starting,
    refuse_running_app,
    serve_http_port,
    shutdown,
    start_ray,
    warn_if_short,
)
from tandem.deploy.serve_banner import local_host, print_urls
from tandem.deploy.serve_guards import (
    busy_ports,
    context_overrun_of,
    error_line,
    fail_if,
    port_conflicts,
)
from tandem.engine.errors import summarize_validation


def serve(
    model_argument: Annotated[
        Path | None,
        typer.Argument(
            metavar="MODEL",
            show_default=False,
            help="The checkpoint, as `vllm serve MODEL` takes it (the same as --model).",
        ),
    ] = None,
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
        int | None,
        typer.Option(
            min=1,
            help="CPUs of a newly started local Ray cluster (default: what the replicas ask "
            "for, at least one per core).",
        ),
    ] = None,
    dashboard_port: Annotated[
        int, typer.Option(min=1, max=65535, help="Ray dashboard port (new cluster).")
    ] = 8265,
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
        list[str] | None,
        typer.Option(
            metavar="NAME",
            help="Model name clients send (default: the checkpoint folder's name, and the "
            "path or Hugging Face repo id as given, as vLLM names it). Repeat it for several "
            "names of the same model: replies carry the first.",
        ),
    ] = None,
    tokenizer: flags.Tokenizer = None,
    max_model_len: flags.MaxModelLen = None,
    stream_interval: flags.StreamInterval = None,
    dtype: flags.Dtype = None,
    gpu_memory_utilization: flags.GpuMemoryUtilization = None,
    max_num_seqs: flags.MaxNumSeqs = None,
    max_num_batched_tokens: flags.MaxNumBatchedTokens = None,
    block_size: flags.BlockSize = None,
    enable_prefix_caching: flags.EnablePrefixCaching = None,
    seed: flags.Seed = None,
    generation_config: flags.GenerationConfig = None,
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
        list[str] | None,
        typer.Option(
            metavar="KEY",
            help="Require 'Authorization: Bearer <key>' on the API (HTTP and gRPC); "
            "/health, /ping and /metrics stay open. Repeat it (or give several after it, "
            "as vLLM) to take any of several keys. Default: TANDEM_API_KEY, else "
            "VLLM_API_KEY (one key each).",
        ),
    ] = None,
    enable_log_requests: vllm_flags.EnableLogRequests = None,
    tensor_parallel_size: vllm_flags.TensorParallelSize = 1,
    pipeline_parallel_size: vllm_flags.PipelineParallelSize = 1,
    enable_chunked_prefill: vllm_flags.EnableChunkedPrefill = True,
    enable_auto_tool_choice: vllm_flags.EnableAutoToolChoice = False,
    trust_remote_code: vllm_flags.TrustRemoteCode = False,
    enforce_eager: vllm_flags.EnforceEager = False,
    disable_log_stats: vllm_flags.DisableLogStats = False,
    swap_space: vllm_flags.SwapSpace = None,
    kv_cache_dtype: vllm_flags.KvCacheDtype = "auto",
    load_format: vllm_flags.LoadFormat = "auto",
    max_seq_len_to_capture: vllm_flags.MaxSeqLenToCapture = None,
    disable_custom_all_reduce: vllm_flags.DisableCustomAllReduce = False,
    task: vllm_flags.Task = "auto",
) -> None:
    """Serve a model with disaggregated prefill and decode on Ray (OpenAI API + gRPC).

    Starts a local Ray cluster with the dashboard when none is running, deploys a router, the
    prefill workers and the decode workers, prints the URLs, and stops cleanly on Ctrl-C.
    """
    if model_argument and model and model_argument.resolve() != model.resolve():
        typer.echo(f"Error: two models given ({model_argument} and --model {model})", err=True)
        raise typer.Exit(code=2)
    model = model or model_argument
    refused = vllm_flags.refused_vllm_flags(
        tensor_parallel_size,
        pipeline_parallel_size,
        enable_chunked_prefill,
        kv_cache_dtype,
        load_format,
        task,
    )
    if refused:
        typer.echo(f"Error: {refused}", err=True)
        raise typer.Exit(code=2)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # (every request's log line as written: Ray folds alike lines of replicas into one)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    overrides = {
        "model": str(model) if model else None,
        "transport": transport,
        "mode": mode,
        "host": host,
        "port": port,
        "grpc_port": grpc_port,
        "direct_port": direct_port,
        "api_key": vllm_flags.api_key_option(api_key, os.environ),
        "chat_template": chat_template,
        "tokenizer": tokenizer,
        "served_model_name": vllm_flags.one_or_list(served_model_name),
    }
    try:
        roles = {"prefill": prefill_replicas, "decode": decode_replicas}
        nested = {
            ("engine", "max_model_len"): max_model_len,
            ("decode", "stream_interval"): stream_interval,
            ("engine", "dtype"): dtype,
            ("engine", "gpu_memory_utilization"): gpu_memory_utilization,
            ("engine", "max_num_seqs"): max_num_seqs,
            ("engine", "max_num_batched_tokens"): max_num_batched_tokens,
            ("engine", "block_size"): block_size,
            ("engine", "enable_prefix_caching"): enable_prefix_caching,
            ("engine", "seed"): seed,
            ("engine", "generation_config"): generation_config,
            ("router", "tool_call_parser"): tool_call_parser,
            ("router", "reasoning_parser"): reasoning_parser,
            ("router", "log_requests"): enable_log_requests,
        }
        env = {"cache_dir": os.environ.get("TANDEM_CACHE_DIR") or None}  # (the file's beats it;
        # set empty: unset)
        cfg = cluster_config_from(config, overrides, roles, nested, env)
        if cfg.mode == "pd":  # (a transport whose package is missing fails here, before Ray)
            from tandem.kv_transfer.registry import transport_class

            transport_class(cfg.transport)
        ignored = _ignored_in_colocated(cfg, prefill_flag=prefill_replicas is not None)
        if ignored:
            typer.echo(f"[tandem] note: {', '.join(ignored)} ignored in colocated mode (the "
                       "decode workers prefill every request themselves)", err=True)  # fmt: skip
        from tandem.deploy.app_builder import build_app, registry_name, resolve_model

        typer.echo("[tandem] preparing the model ...")
        resolved = resolve_model(cfg)  # (the names first: from the model as it was given)
        names = cfg.model_names(resolved)
        cfg = cfg.model_copy(update={"model": resolved, "served_model_name": names})
        fail_if(context_overrun_of(cfg))
        app = build_app(cfg)
    except ValidationError as exc:
        typer.echo(f"Error: invalid configuration: {summarize_validation(exc)}", err=True)
        raise typer.Exit(code=2) from None
    except (ValueError, OSError, ImportError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    if cfg.host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    started = time.monotonic()
    from ray import serve as ray_serve
    from ray.serve.exceptions import RayServeException

    needed = cfg.ray_resources_needed()
    ports = {"--port": cfg.port, "--grpc-port": cfg.grpc_port, "--direct-port": cfg.direct_port}
    ctx, own_cluster = start_ray(
        address, cfg.host, num_cpus, dashboard_port, ingress, needed, ports
    )
    if not own_cluster:
        refuse_running_app(cfg.app_name, ctx)
        if address is None:  # (a cluster running here: the router opens its own ports here;
            # --port is Serve's, which may hold it already)
            own = {k: v for k, v in ports.items() if k != "--port"}
            fail_if(port_conflicts(own) or busy_ports(cfg.host, own))
    warn_if_short(needed, own_cluster)
    stop = threading.Event()
    signals: list[int] = []
    serving = False

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        if not serving:  # starting: stop now, not once every replica is up
            if len(signals) == 1:
                typer.echo("[tandem] interrupted while starting: stopping ...")
            raise KeyboardInterrupt
        if stop.is_set():  # a second Ctrl-C: no more waiting for the drain
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    drain = True  # (false: the cluster tandem started goes as a whole, or is gone)
    failed: str | None = None
    try:
        try:
            ray_serve.start(http_options={"host": cfg.host, "port": cfg.port})
            cfg = _on_serves_port(cfg)
            ray_serve.run(app, name=cfg.app_name, route_prefix="/")
            _wait_for_workers(cfg)
            serving = True
            print_urls(cfg, ctx, time.monotonic() - started, ingress if own_cluster else None)
            while not stop.wait(0.5):
                pass
            drain = not (own_cluster and signal.SIGTERM in signals and cluster_gone())
            _say_stopping(cfg, drain)
        except KeyboardInterrupt:  # while starting (requests already taken finish first)
            drain = not own_cluster
            with contextlib.suppress(KeyboardInterrupt):  # (again: at once)
                drain = drains_when_stopped_starting(
                    registry_name(cfg), own_cluster, signal.SIGTERM in signals
                )
            if drain and own_cluster:
                _say_stopping(cfg, drain)
        except (RuntimeError, RayServeException) as exc:  # Serve could not deploy it (a
            # worker failed to start; another application serves the route prefix "/")
            failed = error_line(exc)
    finally:
        try:
            shutdown(
                cfg.app_name, registry_name(cfg), drain, _drain_s(cfg), cluster_goes=own_cluster
            )
        except KeyboardInterrupt:  # Ctrl-C again while draining: stop at once
            if not own_cluster:  # (the app stays on the cluster tandem joined, serving)
                call_off_stop(registry_name(cfg))
            shutdown(cfg.app_name, registry_name(cfg), drain=False)
    if failed is not None:
        typer.echo(f"Error: {failed} (more in the log above and in Ray's logs: "
                   "/tmp/ray/session_latest/logs/serve/)", err=True)  # fmt: skip
        raise typer.Exit(code=1)
    typer.echo("[tandem] stopped")


def _drain_s(cfg: Any) -> float:
    return float(max(cfg.decode.drain_timeout_s, cfg.prefill.drain_timeout_s))


def _say_stopping(cfg: Any, drain: bool) -> None:
    if drain:
        typer.echo(f"[tandem] stopping: new requests get a 503 while those in flight finish "
                   f"(at most {_drain_s(cfg):g}s; "
                   "Ctrl-C again to stop at once) ...")  # fmt: skip
    else:
        typer.echo("[tandem] stopping: the Ray cluster was stopped with it (the signal reached "
                   "its processes too): nothing left to drain")  # fmt: skip


def _on_serves_port(cfg: Any) -> Any:
    """`cfg` with the port Serve's proxy listens on: on a joined cluster where Serve already
    ran, its own (said so), whatever --port asked."""
    port = serve_http_port(cfg.port)
    if port == cfg.port:
        return cfg
    typer.echo(f"[tandem] note: Serve already runs on this cluster with its HTTP proxy on port "
               f"{port}: the API is there (--port {cfg.port} and --host apply to a Serve that "
               "tandem starts)", err=True)  # fmt: skip
    return cfg.model_copy(update={"port": port})


def _wait_for_workers(cfg: Any, timeout_s: float = 15.0) -> None:
    """Until the router counts the workers the start-up line names (it learns of replicas
    from their reports, a second or two after Serve runs them), for at most `timeout_s`."""
    host = local_host(cfg)
    host = f"[{host}]" if ":" in host else host
    roles = ("decode",) if cfg.mode == "colocated" else ("prefill", "decode")
    expected = {role: getattr(cfg, role).replicas for role in roles}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            url = f"http://{host}:{cfg.port}/health"
            with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 (our own URL)
                workers = json.loads(answer.read()).get("workers") or {}
        except (OSError, ValueError):  # (a 503 while a role has none yet, or not up yet)
            workers = {}
        if all(workers.get(role, 0) >= n for role, n in expected.items()):
            return
        time.sleep(0.25)


def _ignored_in_colocated(cfg: Any, prefill_flag: bool) -> list[str]:
    """The prefill-role settings an operator gave that colocated mode (no prefill workers)
    does not use: the config's `prefill.autoscaling` / `prefill.replicas`, `--prefill-replicas`."""
    if cfg.mode != "colocated":
        return []
    ignored = ["prefill.autoscaling"] if cfg.prefill.autoscaling is not None else []
    if prefill_flag:
        ignored.append("--prefill-replicas")
    elif "replicas" in cfg.prefill.model_fields_set:
        ignored.append("prefill.replicas")
    return ignored
