"""Serve's proxies, at a stop: the last bytes of a stream a router has finished may still be on
their way through one (a proxy lags its router on a busy host). Stopping the cluster under it
would cut that stream, so the stop waits until no proxy is sending a response."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("tandem.deploy")

PROXY_NAMESPACE = "serve"
PROXY_NAME_PREFIX = "SERVE_PROXY_ACTOR"  # (Serve names each node's proxy actor so)
POLL_S = 0.05
TAIL_S = 0.25  # after the count reaches 0: the last write may still be in uvicorn's buffer


def responses_in_proxy(proxy: Any) -> int:
    """Run inside a proxy actor (`__ray_call__`): the requests its HTTP and gRPC proxies are
    still answering (Serve counts one until its response's last message has been sent)."""
    parts = (proxy.http_proxy, proxy.grpc_proxy)  # (AttributeError: not such a proxy)
    return sum(int(part._ongoing_requests) for part in parts if part is not None)


Counter = Callable[[float], int]
"""A proxy's responses in progress, asked with a timeout in seconds."""


def proxy_counters() -> list[Counter]:
    """One counter per live Serve proxy actor."""
    import ray
    from ray.util import list_named_actors

    counters: list[Counter] = []
    for entry in list_named_actors(all_namespaces=True):
        if entry["namespace"] != PROXY_NAMESPACE:
            continue
        if not entry["name"].startswith(PROXY_NAME_PREFIX):
            continue
        try:
            actor = ray.get_actor(entry["name"], namespace=PROXY_NAMESPACE)
        except ValueError:  # (gone meanwhile)
            continue
        counters.append(_counter(actor))
    return counters


def _counter(actor: Any) -> Counter:
    import ray

    def count(timeout: float) -> int:
        return int(ray.get(actor.__ray_call__.remote(responses_in_proxy), timeout=timeout))

    return count


def _found_counters() -> list[Counter]:
    try:
        return proxy_counters()
    except Exception as exc:  # (no Serve here, or an older Ray: nothing to count)
        logger.info("Serve's proxies not found: %s", exc)
        return []


def _busy(counters: list[Counter], timeout_s: float) -> int:
    """The responses `counters` count; a counter that fails (a dead proxy, or not one that
    counts) is dropped from `counters`."""
    busy = 0
    for count in list(counters):
        try:
            busy += int(count(timeout_s))
        except Exception as exc:
            logger.info("not waiting for a Serve proxy: %s", exc)
            counters.remove(count)
    return busy


def responses_in_proxies(timeout_s: float = 2.0) -> int:
    """The responses Serve's proxies are sending now (0 if they cannot be asked)."""
    return _busy(_found_counters(), timeout_s)


def wait_for_proxies(timeout_s: float, counters: list[Counter] | None = None) -> bool:
    """Waits, at most `timeout_s`, until no Serve proxy is sending a response; whether that
    came. A proxy that does not answer is not waited for."""
    counters = _found_counters() if counters is None else counters
    deadline = time.monotonic() + timeout_s
    said = False
    while busy := _busy(counters, max(0.5, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            logger.warning("Serve's proxies still sending %d responses after %gs", busy, timeout_s)
            return False
        if not said:
            logger.info("waiting for Serve's proxies to send %d responses to the end", busy)
            said = True
        time.sleep(POLL_S)
    if said:
        time.sleep(TAIL_S)
    return True
