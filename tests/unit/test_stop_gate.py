"""The router's gate while the application stops (`router/stop_gate.py`) and the registry's side
of it: requests in flight are counted until their response is sent; once the registry says the
application stops, new requests get a 503 OpenAI error (health and metrics still answer)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tandem.engine.worker_registry import WorkerRegistry
from tandem.router.errors import APIError
from tandem.router.stop_gate import StopGate, StopGateMiddleware, follow_stop


def call(gate: StopGate, path: str, seen: list[int] | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request through the middleware; `seen` gets the gate's
    in-flight count while the app answers."""
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if seen is not None:
            seen.append(gate.in_flight)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        if seen is not None:
            seen.append(gate.in_flight)
        await send({"type": "http.response.body", "body": b"two"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(StopGateMiddleware(app, lambda: gate)(scope, receive, send))
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_a_request_counts_in_flight_until_its_whole_response_is_sent() -> None:
    gate = StopGate()
    seen: list[int] = []
    assert call(gate, "/v1/completions", seen) == (200, {}, b"onetwo")
    assert seen == [1, 1]
    assert gate.in_flight == 0


def test_once_stopping_a_new_request_gets_a_503_openai_error() -> None:
    gate = StopGate()
    gate.stopping = True
    status, headers, body = call(gate, "/v1/chat/completions")
    assert status == 503
    assert headers["retry-after"] == "1"
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "shutting_down")
    assert gate.in_flight == 0


@pytest.mark.parametrize("path", ["/health", "/metrics", "/ping"])
def test_health_and_metrics_pass_the_gate(path: str) -> None:
    gate = StopGate()
    gate.stopping = True
    assert call(gate, path)[0] == 200  # (health's own handler then answers "stopping")


def test_admitted_raises_the_refusal_and_counts_only_admitted_requests() -> None:
    gate = StopGate()
    with gate.admitted():
        assert gate.in_flight == 1
        gate.stopping = True
        with pytest.raises(APIError) as refused, gate.admitted():
            pass
        assert (refused.value.status, refused.value.code) == (503, "shutting_down")
        assert gate.in_flight == 1  # (the one admitted before)
    assert gate.in_flight == 0


def test_the_registry_tells_routers_and_lists_their_requests_in_flight() -> None:
    registry = WorkerRegistry()
    assert registry.router_report("router/a", 2) == ""
    registry.begin_stop()
    assert registry.routers() == [
        {"router_id": "router/a", "in_flight": 2, "stopping": False,
         "reported_at": registry.routers()[0]["reported_at"]}
    ]  # fmt: skip
    assert registry.router_report("router/a", 1) == "stopping"
    assert [(r["in_flight"], r["stopping"]) for r in registry.routers()] == [(1, True)]
    registry.end_requests()  # (the stop's drain ran out)
    assert registry.router_report("router/a", 1) == "ending"
    assert registry.routers(max_age_s=-1.0) == []  # (stale reports are left out)
    registry.end_stop()  # (called off: a second Ctrl-C, the app left on a joined cluster)
    assert registry.router_report("router/a", 0) == ""


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def answer() -> Any:
            return self.fn(*args)

        return answer()


class _FakeRegistryActor:
    def __init__(self, registry: WorkerRegistry) -> None:
        self.router_report = _Remote(registry.router_report)


def test_follow_stop_reports_in_flight_closes_the_gate_and_ends_requests_once() -> None:
    registry = WorkerRegistry()
    actor = _FakeRegistryActor(registry)
    gate = StopGate()
    gate.in_flight = 3
    ended: list[int] = []

    async def until(condition: Any) -> None:
        for _ in range(40):
            await asyncio.sleep(0.05)
            if condition():
                return

    async def run() -> None:
        task = asyncio.create_task(
            follow_stop(gate, "router/x", lambda: actor, lambda: ended.append(1))
        )
        await asyncio.sleep(0.05)
        assert not gate.stopping
        registry.begin_stop()
        await until(lambda: gate.stopping)
        assert gate.stopping and ended == []
        registry.end_requests()
        await until(lambda: ended)
        await asyncio.sleep(1.2)  # (two more reports: ended once only)
        task.cancel()

    asyncio.run(run())
    assert gate.stopping and ended == [1]
    assert [(r["router_id"], r["in_flight"]) for r in registry.routers()] == [("router/x", 3)]
