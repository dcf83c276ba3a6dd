"""Server reflection under both of its names: `grpc.reflection.v1alpha` (grpcio-reflection's)
and `grpc.reflection.v1`, the current one, which clients that speak only v1 ask (grpcurl and
Go's clients try v1 first). The two protocols' messages are the same field for field, so v1 is
served by the same servicer with v1alpha's message classes."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(services: Sequence[str], server: grpc.aio.Server) -> None:
    """Reflection of `services` on `server`, as v1alpha and as v1."""
    reflection.enable_server_reflection(services, server)
    servicer = reflection.aio.ReflectionServicer(services)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers),)
    )
    server.add_registered_method_handlers(V1_SERVICE_NAME, handlers)
