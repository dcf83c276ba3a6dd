"""The Ray cluster `tandem serve` runs on: started here, or joined (refusing one that already
runs the application), checked for room, and shut down (the application drained first)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import typer

from tandem.deploy.ingress import STATE_DIR, Ingress, ingress_environment
from tandem.deploy.serve_guards import (
    app_conflict,
    busy_ports,
    dialed,
    fail,
    fail_if,
    first_line,
    port_conflicts,
    unreachable,
)
from tandem.deploy.serve_proxies import responses_in_proxies, wait_for_proxies

logger = logging.getLogger("tandem.deploy")


def start_ray(
    address: str | None,
    host: str,
    num_cpus: int | None,
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
        fail_if(unreachable(address, dialed(address)))
        try:
            return ray.init(address=address), False
        except (ConnectionError, RuntimeError, ValueError) as exc:
            fail(f"cannot join the Ray cluster at {address}: {first_line(exc)}")
    if address is None:
        try:
            ctx = ray.init(address="auto")
            typer.echo("[tandem] joined the Ray cluster running here: its Serve ingress is the one "
                       "it was started with (--ingress applies to clusters tandem starts)")  # fmt: skip
            return ctx, False
        except ConnectionError:
            pass
        except RuntimeError as exc:  # one is running, but refuses us (e.g. its auth token)
            fail(
                f"cannot join the Ray cluster running here: {first_line(exc)} (--address local "
                "starts a cluster of its own)"
            )
    ports = {**ports, "--dashboard-port": dashboard_port}
    fail_if(port_conflicts(ports))
    fail_if(busy_ports(host, ports))
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


def refuse_running_app(app_name: str, ctx: Any) -> None:
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
        fail_if(error)


def resource_shortfall(needed: dict[str, float], total: dict[str, float]) -> dict[str, float]:
    """What of `needed` a cluster with `total` resources lacks: {resource: missing amount}."""
    return {
        name: round(amount - total.get(name, 0.0), 6)
        for name, amount in needed.items()
        if total.get(name, 0.0) + 1e-9 < amount
    }


def warn_if_short(needed: dict[str, float], own_cluster: bool = False) -> None:
    """Says so when the cluster lacks resources the deployment asks for: Serve would wait for
    them without a word beyond its own log (an autoscaling cluster may still add them). The
    local cluster this command started never grows: there it is an error (Ray stopped)."""
    import ray

    total = {k: float(v) for k, v in ray.cluster_resources().items()}
    missing = resource_shortfall(needed, total)
    if missing:
        asks = ", ".join(f"{k} {needed[k]:g} (has {total.get(k, 0):g})" for k in sorted(missing))
        if own_cluster:
            ray.shutdown()
            fail(
                f"the deployment asks for {asks}, which the local Ray cluster started here "
                "cannot give (lower num_cpus / num_gpus / resources per role, or run on a "
                "cluster that has them: --address)"
            )
        typer.echo(
            f"[tandem] warning: the deployment asks for {asks}; replicas that do not fit wait "
            "until the cluster has room (lower num_cpus / num_gpus / resources per role, or "
            "--num-cpus for a cluster tandem starts)",
            err=True,
        )


def cluster_gone(wait_s: float = 1.0) -> bool:
    """Whether a process of the Ray head this command started (its GCS, its raylet) died,
    within `wait_s`: a SIGTERM sent to the whole process group (`timeout`, an init system)
    reaches them too, and nothing is left to drain (waiting for the GCS would take a minute)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is None or not node.all_processes:  # (a cluster joined: not this command's)
        return False
    deadline = time.monotonic() + wait_s
    while not node.dead_processes():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def serve_http_port(wanted: int) -> int:
    """The port of the Serve proxy: `wanted`, unless Serve already ran on the joined cluster
    with another one (it keeps its own: Ray then ignores `http_options`)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    port = getattr(getattr(client, "http_config", None), "port", None)
    return int(port) if isinstance(port, int) else wanted


PROXY_WAIT_S = 10.0
"""How long the stop waits at most for Serve's proxies to send what the routers finished."""

ENDING_WAIT_S = 5.0
"""How long the routers get to end the requests still running once the stop's drain ran out."""


def wait_for_routers(registry_name: str, timeout_s: float, settle_s: float = 3.0) -> None:
    """Tells the routers the application stops (through the worker registry) and waits, at
    most `timeout_s`, until every router that reports has seen it and has no request left in
    flight; then has them end the requests still running. Routers that never report (none
    within `settle_s`) are not waited for."""
    import ray

    from tandem.engine.worker_registry import find_registry

    registry = find_registry(registry_name)
    if registry is None:  # (nothing reports)
        return
    ray.get(registry.begin_stop.remote(), timeout=10)

    said = False

    def drained(routers: list[dict[str, Any]], waited: float) -> bool:
        nonlocal said
        if not routers:
            return waited >= settle_s
        in_flight = sum(int(r["in_flight"]) for r in routers)
        if in_flight and not said:  # (once: what the stop now waits for)
            logger.info("waiting for %d requests in flight", in_flight)
            said = True
        return in_flight == 0 and all(r["stopping"] for r in routers)

    if _poll_routers(registry, settle_s, timeout_s, drained):
        return
    # The drain ran out: the routers end what they still run, each with an error that says so.
    logger.warning("requests still in flight after %gs: ending them", timeout_s)
    ray.get(registry.end_requests.remote(), timeout=10)
    _poll_routers(
        registry, settle_s, ENDING_WAIT_S, lambda rs, _: not any(r["in_flight"] for r in rs)
    )


def _poll_routers(
    registry: Any,
    settle_s: float,
    timeout_s: float,
    done: Callable[[list[dict[str, Any]], float], bool],
) -> bool:
    """Whether `done(routers that reported within settle_s, seconds waited)` held within
    `timeout_s` (asked every 0.2 s)."""
    import ray

    started = time.monotonic()
    while (waited := time.monotonic() - started) < timeout_s:
        if done(ray.get(registry.routers.remote(settle_s), timeout=10), waited):
            return True
        time.sleep(0.2)
    return False


def _ask_registry(registry_name: str, method: str, timeout_s: float = 5.0) -> Any:
    """`method`'s answer from the app's worker registry (None: no registry, or no answer)."""
    import ray

    from tandem.engine.worker_registry import find_registry

    with contextlib.suppress(Exception):
        if (registry := find_registry(registry_name)) is not None:
            return ray.get(getattr(registry, method).remote(), timeout=timeout_s)
    return None


def drains_when_stopped_starting(registry_name: str, own_cluster: bool, terminated: bool) -> bool:
    """Whether a stop that comes while `tandem serve` still waits for the app to start drains
    it. On a cluster it joined, yes (the app goes, the cluster stays). On its own one only if a
    router already runs requests (Serve runs the routers before it says the app runs): a stop
    while the workers load is not held up by a drain of nothing; nor when a SIGTERM took the
    cluster's head with it."""
    if not own_cluster:
        return True
    if terminated and cluster_gone():
        return False
    routers = _ask_registry(registry_name, "routers", timeout_s=2.0) or []
    if any(int(router.get("in_flight", 0)) > 0 for router in routers):
        return True
    # (a router reports every half second: a request it took since is seen by Serve's proxy)
    return bool(routers) and responses_in_proxies() > 0


def call_off_stop(registry_name: str) -> None:
    """The routers take requests again (a stop begun, then called off by a second Ctrl-C on a
    cluster that lives on, with the app on it)."""
    _ask_registry(registry_name, "end_stop")


def shutdown(
    app_name: str,
    registry: str,
    drain: bool = True,
    drain_s: float = 30.0,
    *,
    cluster_goes: bool = False,
) -> None:
    """Deletes the app (its requests drained first, `drain_s` at most) and leaves Ray; with
    `drain` false (the cluster is gone) only leaves Ray. `cluster_goes`: leaving Ray stops
    the cluster (tandem started it), Serve's proxy with it."""
    import ray
    from ray import serve as ray_serve

    from tandem.engine.worker_registry import kill_registry

    if not drain:
        ray.shutdown()
        return
    try:
        # The routers refuse new requests with a 503 while theirs in flight finish; then
        # deleting the app drains it (the router and the workers wait for the requests,
        # streams and KV transfers still in flight). Deleted at once, Serve's proxy would
        # answer the new ones 404 meanwhile; Serve's own shutdown would stop its proxy first
        # and cut every stream.
        wait_for_routers(registry, drain_s)
        if cluster_goes:  # (a stream its router finished may still be on its way through
            # Serve's proxy, which would go with the cluster; on a cluster that lives on, the
            # proxy sends it to the end, and other applications' requests would be waited for)
            wait_for_proxies(PROXY_WAIT_S)
        ray_serve.delete(app_name)
        kill_registry(registry)
        # Serve's controller and proxies go with a cluster this command started (`ray.shutdown`
        # below tears it down); `serve.shutdown()` would only add a warning, as it kills its
        # controller mid-call. On a cluster it joined, Serve stays for its other apps.
    except Exception as exc:  # shutting down anyway: say what failed
        logger.warning("clean shutdown incomplete: %s", exc)
    finally:
        ray.shutdown()
