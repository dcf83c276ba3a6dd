"""Transports by name, imported only when chosen (optional dependencies stay optional)."""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from typing import Any

import pydantic

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


def option_names(name: str) -> set[str] | None:
    """The options the transport called `name` takes (its constructor's keyword arguments
    after the cluster token); None when it cannot be imported here (ucx without ucxx)."""
    try:
        cls = transport_class(name)
    except ImportError:
        return None
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # (self, token)
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def check_options(name: str, options: dict[str, Any]) -> None:
    """ValueError naming the options the transport called `name` does not take, or a value
    not of the type its constructor declares (strictly: "5" is not an int)."""
    if not options:
        return
    known = option_names(name)
    if known is None:
        return
    if unknown := sorted(set(options) - known):
        takes = ", ".join(sorted(known)) or "none"
        raise ValueError(f"transport {name!r} has no option {unknown} (it takes: {takes})")
    hints = typing.get_type_hints(transport_class(name).__init__)
    for option, value in options.items():
        if option in hints:
            try:
                pydantic.TypeAdapter(hints[option]).validate_python(value, strict=True)
            except pydantic.ValidationError:
                kind = getattr(hints[option], "__name__", str(hints[option]))
                raise ValueError(
                    f"transport {name!r} option {option}: {value!r} is not of type {kind}"
                ) from None


def reachable_options(name: str, options: dict[str, Any], node_ip: str) -> dict[str, Any]:
    """`options` for a worker's transport, with the address of the node it runs on where the
    transport listens on one and none is given (a peer on another node or pod dials the
    address the transport advertises: loopback, its default, reaches nobody there)."""
    known = option_names(name) or set()
    if "host" in known and not {"host", "advertise_host"} & set(options):
        return {**options, "host": node_ip}
    return dict(options)


def pool_factory(transport: KVTransport, *, send_only: bool = False) -> Any:
    """The engine's `kv_pool_factory` for `transport`: its `allocate_pool` where it has one
    (`send_only` for an engine whose pages only go out, a prefill worker's), else None."""
    allocate = getattr(transport, "allocate_pool", None)
    if allocate is None or not send_only:
        return allocate
    return functools.partial(allocate, send_only=True)
