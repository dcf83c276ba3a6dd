"""The gRPC server's health service, in line with the router's HTTP `/health`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

logger = logging.getLogger("tandem.router")

SERVICE_NAME = "tandem.v1.Generation"
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


HEALTH_EVERY_S = 1.0
"""How often the health service's status is brought in line with the router's `/health`."""


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
        while True:
            try:
                now = bool(self.ready())
            except Exception:  # (a check that fails says "not serving")
                logger.exception("gRPC health: the readiness check failed")
                now = False
            if now != serving:
                status = health_pb2.HealthCheckResponse.SERVING if now else _NOT_SERVING
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
