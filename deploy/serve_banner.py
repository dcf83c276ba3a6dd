"""What `tandem serve` prints once the application is up: the workers and the URLs."""

from __future__ import annotations

from typing import Any

import typer

from tandem.deploy.ingress import Ingress


def scaling_range(role: Any) -> str:
    """' (autoscaling MIN..MAX)' for an autoscaled role, else ''."""
    scaling = role.autoscaling
    return f" (autoscaling {scaling.min_replicas}..{scaling.max_replicas})" if scaling else ""


def local_host(cfg: Any) -> str:
    """Where this machine reaches the API: `--host`, or 127.0.0.1 for every-interface hosts."""
    return str(cfg.host) if cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"


def workers_summary(cfg: Any) -> str:
    """The roles as the start-up line names them: counts, and each autoscaled role's range."""
    if cfg.mode == "colocated":
        workers = "worker" if cfg.decode.replicas == 1 else "workers"
        return f"{cfg.decode.replicas} colocated {workers} (prefill + decode){scaling_range(cfg.decode)}"
    return (
        f"{cfg.prefill.replicas} prefill{scaling_range(cfg.prefill)} + {cfg.decode.replicas} "
        f"decode{scaling_range(cfg.decode)} workers, {cfg.transport} KV transport"
    )


def print_urls(cfg: Any, ctx: Any, seconds: float, ingress: Ingress | None) -> None:
    """`ingress`: what the cluster tandem started uses (None: a cluster it joined)."""
    host = local_host(cfg)
    dashboard = getattr(ctx, "dashboard_url", None)
    lines = [
        f"[tandem] serving {' / '.join(cfg.model_names(cfg.model))}: "
        f"{workers_summary(cfg)}, "
        f"ready in {seconds:.1f}s",
        f"[tandem]   OpenAI API:    http://{host}:{cfg.port}/v1"
        + (f" (through {ingress.value})" if ingress else "")
        + (" (API key required: 'Authorization: Bearer <key>')" if cfg.api_keys() else "")
        + (
            " (the API key given is empty: no key is required)"
            if cfg.api_key is not None and not cfg.api_keys()
            else ""
        ),
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
