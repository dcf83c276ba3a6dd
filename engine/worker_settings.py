"""What a prefill or decode worker needs to start (built by `tandem.deploy` from the cluster config).

Plain pydantic, JSON-able: it travels to the worker as a Ray Serve deployment argument.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.config import EngineConfig


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["prefill", "decode"]
    engine: EngineConfig
    transport: str = "shm"
    transport_options: dict[str, Any] = Field(default_factory=dict)
    auth_token: str = Field(min_length=1)
    registry_name: str | None = None
    torch_threads: int = Field(1, ge=1)
    lease_s: float = Field(30.0, gt=0)
    stall_timeout_s: float = Field(10.0, gt=0)
    reserve_wait_s: float = Field(60.0, ge=0)  # decode: how long a reservation waits for room
    ack_timeout_s: float = Field(10.0, gt=0)
    drain_timeout_s: float = Field(30.0, gt=0)
    checksums: bool = False
    hand_off: bool = True  # prefill: chunks leave from a publishing thread (`ChunkPublisher`)
    stream_interval: int = Field(1, ge=1)  # decode: tokens a stream gathers before they go out


def create_engine_and_transport(
    settings: WorkerSettings, node_ip: str | None = None
) -> tuple[Any, Any]:
    """The worker's KV transport, and its engine with the KV pool where the transport wants it.
    `node_ip`: the address of the worker's node, where its transport listens unless its
    options say where."""
    import torch

    from tandem.engine.llm_engine import LLMEngine
    from tandem.kv_transfer.registry import create_transport, pool_factory, reachable_options

    torch.set_num_threads(settings.torch_threads)
    options = settings.transport_options
    if node_ip is not None:
        options = reachable_options(settings.transport, options, node_ip)
    transport = create_transport(settings.transport, settings.auth_token, **options)
    config = settings.engine.model_copy(update={"enable_kv_events": True})  # for the router
    factory = pool_factory(transport, send_only=settings.role == "prefill")
    try:
        engine = LLMEngine(config, kv_pool_factory=factory)
    except BaseException:
        transport.close()
        raise
    return engine, transport
