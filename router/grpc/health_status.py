"""The gRPC server's health service, in line with the router's HTTP `/health`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger("tandem.router")

SERVICE_NAME = "tandem.v1.Generation"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


HEALTH_EVERY_S = 0.25
"""How often the health service's status is brought in line with the router's `/health` (and
its stop gate: NOT_SERVING within this of the HTTP ports' 503s)."""


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 `Check`, `List` and `Watch`, with grpc's reference servicer's `set` and
    `enter_graceful_shutdown`. Its `Watch` streams end once they have sent the status of
    shutdown (NOT_SERVING): the reference's never end, so one open watcher (a client doing
    client-side health checking) held the server's `stop` for its whole grace."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": _SERVING}
        self._changed = asyncio.Condition()
        self._stopping = False

    async def set(self, service: str, status: int) -> None:
        """Sets `service`'s status, unless shutdown has begun."""
        async with self._changed:
            if not self._stopping:
                self._status[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on; watchers are told and their streams end."""
        async with self._changed:
            self._stopping = True
            self._status = dict.fromkeys(self._status, _NOT_SERVING)
            self._changed.notify_all()

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 - the RPC's name
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: Any, context: Any) -> Any:  # noqa: N802 - the RPC's name
        """Every service's status (grpc.health.v1's `List`, newer than `Check`)."""
        statuses = {
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._status.items()
        }
        return health_pb2.HealthListResponse(statuses=statuses)

    async def Watch(self, request: Any, context: Any) -> None:  # noqa: N802 - the RPC's name
        sent: int | None = None
        while True:
            async with self._changed:
                while (
                    status := self._status.get(request.service, _SERVICE_UNKNOWN)
                ) == sent and not self._stopping:
                    await self._changed.wait()
                stopping = self._stopping
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if stopping:
                return


class GrpcServer:
    """The running gRPC server, with its health service following `ready` (the check of HTTP's
    `/health`): SERVING while it holds, NOT_SERVING otherwise and from `stop` on."""

    def __init__(
        self, server: grpc.aio.Server, port: int, health_servicer: Any, ready: Callable[[], bool]
    ) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.ready = ready
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        serving: bool | None = None
        failing = False  # (a failing check is logged when it starts failing, not every round)
        while True:
            try:
                now, failing = bool(self.ready()), False
            except Exception:  # (a check that fails says "not serving")
                if not failing:
                    logger.exception("gRPC health: the readiness check failed")
                now, failing = False, True
            if now != serving:
                status = _SERVING if now else _NOT_SERVING
                for service in ("", SERVICE_NAME):
                    await self.health.set(service, status)
                if serving is not None:
                    logger.info("gRPC health: %s", "SERVING" if now else "NOT_SERVING")
                serving = now
            await asyncio.sleep(HEALTH_EVERY_S)

    async def stop(self, grace: float | None) -> None:
        """NOT_SERVING from now on; calls in flight get `grace` seconds to end."""
        self._task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
