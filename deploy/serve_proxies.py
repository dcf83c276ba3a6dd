"""Serve's proxies, at a stop: the last bytes of a stream a router has finished may still be on
their way through one (a proxy that lags its router on a busy host, a client that reads
slowly). Stopping the cluster under it would cut that stream, so the stop waits until no
proxy is sending a response."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("tandem.deploy")

PROXY_NAMESPACE = "serve"
PROXY_NAME_PREFIX = "SERVE_PROXY_ACTOR"  # (Serve names each node's proxy actor so)
POLL_S = 0.05


def responses_in_proxy(proxy: Any) -> int:
    """Run inside a proxy actor (`__ray_call__`): the requests its HTTP and gRPC proxies are
    still answering (Serve counts one until its response's last message has been sent)."""
    parts = (getattr(proxy, "http_proxy", None), getattr(proxy, "grpc_proxy", None))
    return sum(int(getattr(part, "_ongoing_requests", 0)) for part in parts if part is not None)


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


def wait_for_proxies(timeout_s: float, counters: list[Counter] | None = None) -> bool:
    """Waits, at most `timeout_s`, until no Serve proxy is sending a response; whether that
    came. A proxy that does not answer is not waited for."""
    if counters is None:
        try:
            counters = proxy_counters()
        except Exception as exc:  # (no Serve here, or an older Ray: nothing to wait for)
            logger.info("Serve's proxies not found: %s", exc)
            return True
    deadline = time.monotonic() + timeout_s
    said = False
    while counters:
        busy = 0
        for count in list(counters):
            try:
                busy += int(count(max(0.5, deadline - time.monotonic())))
            except Exception:  # (dead, or does not count: not waited for)
                counters.remove(count)
        if busy == 0:
            return True
        if time.monotonic() >= deadline:
            logger.warning("Serve's proxies still sending %d responses after %gs", busy, timeout_s)
            return False
        if not said:
            logger.info("waiting for Serve's proxies to send %d responses to the end", busy)
            said = True
        time.sleep(POLL_S)
    return True
