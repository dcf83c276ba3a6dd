"""How HTTP reaches the router: Ray Serve's Python proxy, or HAProxy straight to the replicas.

Ray 2.60 can put HAProxy in front of Serve (``RAY_SERVE_ENABLE_HA_PROXY=1``, experimental in
Ray): each router replica then serves HTTP on its own port and HAProxy forwards each request
to one of them, instead of the proxy actor relaying every request and every SSE chunk through
a Python event loop and an actor call. Measured here (`bench/overhead.py`, 2 cores), the
streaming TTFT over HTTP goes from about 15 ms to about 8 ms.

The cost, observed: a client that leaves during a long prefill is not always noticed before
the prefill ends (`tests/integration/test_cancel_during_prefill.py` failed 1 run in 4 with
HAProxy, and once in CI, against 0 in 5 with the proxy: the prefill ran to its end, its blocks
were released). The likely cause, not verified: HAProxy passes the disconnect on only when the
response next writes, and nothing is written before the first token. The proxy stays the
default.

Both settings are read by the Ray processes when they start, so they apply only to a cluster
that tandem starts itself (`tandem serve`, the tests); a cluster you join keeps its own.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Mapping
from enum import StrEnum

HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
DRAINING_PERIOD = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
_HAPROXY_PORTS = {  # Ray's defaults
    "RAY_SERVE_HAPROXY_STATS_PORT": 8404,
    "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
    # HAProxy's backup server while no router replica passes its health checks yet: on
    # another cluster's port it would send the first requests to that cluster's app.
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 9500,
}
STATE_DIR = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"
_REPLICA_PORT_RANGES = {  # (first, last) of Ray's defaults, per protocol
    "HTTP": (30000, 31000),
    "GRPC": (40000, 41000),
}
_HAPROXY_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
}
LOCAL_DRAINING_PERIOD_S = 2.0
"""How long a stopping router replica keeps accepting HTTP on a local cluster (Ray's default,
30 s, gives external load balancers time to notice; HAProxy here is told at once)."""


class Ingress(StrEnum):
    haproxy = "haproxy"
    proxy = "proxy"


DEFAULT_INGRESS = Ingress.proxy
"""What `tandem serve`, the overhead bench and the integration tests use unless told: Serve's
proxy. HAProxy is about 7 ms faster to the first token over HTTP here (`docs/benchmarks.md`),
but behind it a waiting stream must write SSE comments for a client's leaving to be noticed
(`tandem.router.sse_keepalive.KEEPALIVE_S`), and clients that parse every SSE line as JSON (as
`vllm bench serve`'s does) fail on those."""


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ingress_environment(ingress: Ingress, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before starting a local Ray cluster with `ingress`. The choice
    itself always; HAProxy's tuning only where `environ` does not set it already: its own state
    directory, and free ports where another cluster on this machine holds a default one."""
    if ingress is Ingress.proxy:
        return {HAPROXY_FLAG: "0"}
    env = {DRAINING_PERIOD: str(LOCAL_DRAINING_PERIOD_S)}
    state = tempfile.mkdtemp(prefix="tandem-haproxy-")
    env[STATE_DIR] = state
    env.update({name: f"{state}/{file}" for name, file in _HAPROXY_FILES.items()})
    for name, default in _HAPROXY_PORTS.items():
        env[name] = str(default if _port_is_free(default) else _free_port())
    for protocol, (first, last) in _REPLICA_PORT_RANGES.items():
        # Router replicas take ports from this range. Two clusters on one machine must not
        # share it: HAProxy would forward to the other cluster's replica on a port it holds.
        if not _port_is_free(first):
            width = last - first
            first = _free_port()
            last = min(first + width, 65535)
        env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"] = str(first)
        env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"] = str(last)
    return {HAPROXY_FLAG: "1"} | {k: v for k, v in env.items() if k not in environ}
