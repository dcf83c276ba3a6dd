"""The environment `tandem serve` gives a Ray cluster it starts, per ingress."""

from __future__ import annotations

import os
import socket

from tandem.deploy.ingress import (
    DRAINING_PERIOD,
    HAPROXY_FLAG,
    Ingress,
    ingress_environment,
)


def test_the_proxy_ingress_switches_haproxy_off_even_when_the_environment_has_it_on() -> None:
    env = ingress_environment(Ingress.proxy, {HAPROXY_FLAG: "1"})
    assert env == {HAPROXY_FLAG: "0"}


def test_haproxy_gets_its_own_state_directory_and_a_short_local_drain() -> None:
    env = ingress_environment(Ingress.haproxy, {})
    assert env[HAPROXY_FLAG] == "1"
    assert env[DRAINING_PERIOD] == "2.0"
    state = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    assert os.path.basename(state).startswith("tandem-haproxy-") and os.path.isdir(state)
    assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] == f"{state}/haproxy.cfg"
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == f"{state}/admin.sock"
    assert env["RAY_SERVE_HAPROXY_SERVER_STATE_FILE"] == f"{state}/server-state"
    os.rmdir(state)


def test_what_the_user_set_stays_except_the_choice_itself() -> None:
    user = {HAPROXY_FLAG: "0", DRAINING_PERIOD: "30", "RAY_SERVE_HAPROXY_STATS_PORT": "18404"}
    env = ingress_environment(Ingress.haproxy, user)
    assert env[HAPROXY_FLAG] == "1"
    assert DRAINING_PERIOD not in env and "RAY_SERVE_HAPROXY_STATS_PORT" not in env
    os.rmdir(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])


def _hold(port: int) -> socket.socket | None:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", port))
    except OSError:  # already held by someone else: just as good for these tests
        holder.close()
        return None
    return holder


def test_busy_default_ports_are_replaced_by_free_ones() -> None:
    """Another cluster on the machine (the tests' own, say) holds HAProxy's stats port, the
    fallback proxy's port and the first port of the router replicas' range: this cluster must
    not forward to that one's app."""
    holders = [_hold(8404), _hold(8500), _hold(30000)]
    try:
        env = ingress_environment(Ingress.haproxy, {})
        for name, default in (("HAPROXY_STATS", 8404), ("FALLBACK_PROXY_HTTP", 8500)):
            port = int(env[f"RAY_SERVE_{name}_PORT"])
            assert port != default and 0 < port < 65536
        first = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
        last = int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])
        assert first != 30000 and first < last <= 65535
        os.rmdir(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
    finally:
        for holder in holders:
            if holder is not None:
                holder.close()
