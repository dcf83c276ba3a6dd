"""Transports by name, imported only when chosen (optional dependencies stay optional)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from tandem.kv_transfer.base import KVTransport

TRANSPORTS: dict[str, str] = {
    "local": "tandem.kv_transfer.local:LocalTransport",
    "fake": "tandem.kv_transfer.fake:FakeTransport",
    "shm": "tandem.kv_transfer.shm:ShmTransport",
    "torch": "tandem.kv_transfer.torch_dist:TorchDistTransport",
    "ucx": "tandem.kv_transfer.ucx:UcxTransport",
}


def transport_class(name: str) -> type[KVTransport]:
    try:
        target = TRANSPORTS[name]
    except KeyError:
        known = ", ".join(sorted(TRANSPORTS))
        raise ValueError(f"unknown KV transport {name!r} (known: {known})") from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = " (install tandem-serve[ucx])" if name == "ucx" else ""
        raise ImportError(f"KV transport {name!r} is not available: {exc}{hint}") from exc
    cls: type[KVTransport] = getattr(module, attr)
    return cls


def create_transport(name: str, auth_token: str, **options: Any) -> KVTransport:
    """Instantiates the transport called `name` with the cluster token and its own options."""
    return transport_class(name)(auth_token, **options)


def pool_factory(transport: KVTransport, *, send_only: bool = False) -> Any:
    """The engine's `kv_pool_factory` for `transport`: its `allocate_pool` where it has one
    (`send_only` for an engine whose pages only go out, a prefill worker's), else None."""
    allocate = getattr(transport, "allocate_pool", None)
    if allocate is None or not send_only:
        return allocate
    return functools.partial(allocate, send_only=True)
