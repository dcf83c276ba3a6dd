"""Length-prefixed JSON frames over a stream socket, and small helpers shared by the transports.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON whose top level
is an object. Nothing received is ever unpickled; frames larger than the reader's limit close the
connection (`FrameError`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from tandem.kv_transfer.manifest import TransferError

_LEN = struct.Struct("!I")
HANDSHAKE_FRAME_LIMIT = 64 * 1024
"""The largest frame accepted before the peer has authenticated."""
FRAME_LIMIT = 64 * 1024 * 1024
"""The largest frame accepted from an authenticated peer (headers are small; this is a fuse)."""

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
    )
}


@dataclass(eq=False)
class Outgoing:
    """One queued send: the header as JSON text plus what the transport needs to move pages."""

    peer: str
    header_json: str
    request_id: str | None
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...] | None


@dataclass(eq=False)
class Link:
    """An authenticated outgoing connection to one peer (this side sends on it)."""

    peer: str
    sock: socket.socket
    rfile: BinaryIO
    welcome: dict[str, Any]
    state: Any = None
    failed: bool = False
    pending: list[bytes] = field(default_factory=list)


@dataclass(eq=False)
class Conn:
    """An accepted connection (this side receives on it); `peer` is set once authenticated."""

    sock: socket.socket
    peer: str = ""
    state: Any = None
    pid: int | None = None  # the sending process, where known (`_peer_process.sender_pid`)
    rfile: BinaryIO | None = field(default=None, repr=False)


class FrameError(TransferError):
    """A peer sent something that is not a valid frame (too large, not JSON, not an object)."""


def encode_frame(payload: Mapping[str, Any] | str) -> bytes:
    """The bytes of one frame; `payload` is an object or its JSON text."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    data = text.encode()
    return _LEN.pack(len(data)) + data


def send_frame(sock: socket.socket, payload: Mapping[str, Any] | str) -> None:
    sock.sendall(encode_frame(payload))


def read_frame(stream: BinaryIO, limit: int = FRAME_LIMIT) -> dict[str, Any] | None:
    """The next frame's object from a buffered socket file, or None at a clean end of stream."""
    head = stream.read(_LEN.size)
    if not head:
        return None
    if len(head) != _LEN.size:
        raise FrameError("connection closed inside a frame header")
    (size,) = _LEN.unpack(head)
    if size > limit:
        raise FrameError(f"frame of {size} bytes exceeds the limit of {limit}")
    data = stream.read(size)
    if len(data) != size:
        raise FrameError("connection closed inside a frame")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    return obj


def shutdown_and_close(sock: socket.socket | None) -> None:
    """Wakes any thread blocked on `sock` and closes it; never raises."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object) -> torch.dtype:
    """The torch dtype called `name` (only plain numeric dtypes are accepted)."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise FrameError(f"unsupported dtype {name!r}")
    return _DTYPES[name]


def parse_shape(value: object, ndim: int) -> tuple[int, ...]:
    """A shape of `ndim` non-negative ints, or `FrameError`."""
    if (
        not isinstance(value, list)
        or len(value) != ndim
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise FrameError(f"bad shape {value!r}")
    return tuple(value)


def request_id_of(header: Mapping[str, Any]) -> str | None:
    """`header["request_id"]`, else `header["manifest"]["request_id"]`, else None."""
    rid = header.get("request_id")
    if rid is None:
        manifest = header.get("manifest")
        if isinstance(manifest, Mapping):
            rid = manifest.get("request_id")
    return rid if isinstance(rid, str) else None


def dst_block_ids_of(header: Mapping[str, Any]) -> tuple[int, ...] | None:
    """`header["manifest"]["dst_block_ids"]` when it is a list of ints, else None."""
    manifest = header.get("manifest")
    if not isinstance(manifest, Mapping):
        return None
    ids = manifest.get("dst_block_ids")
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:  # (bool is not int)
        return None
    return tuple(ids)


def consecutive_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(src_start, dst_start, length)` runs over which both id lists increase by one."""
    n = len(src)
    if n and len(dst) == n:  # one run (a chunk of fresh blocks, usually): checked at C speed
        s0, d0 = src[0], dst[0]
        if _is_range(src, s0, n) and _is_range(dst, d0, n):
            return [(s0, d0, n)]
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def _is_range(ids: Sequence[int], start: int, n: int) -> bool:
    """Whether `ids` (of length `n`) are the ints `start, start + 1, ...`."""
    if type(ids) is range:
        return ids.step == 1
    if type(start) is not int or ids[-1] != start + n - 1:
        return False
    return list(ids) == list(range(start, start + n))


def valid_block_ids(ids: Sequence[int], num_blocks: int) -> bool:
    """All ids are in `[0, num_blocks)` and none repeats."""
    # Builtins only, no generator: this runs on a prefill's hot path for every chunk.
    return not ids or (min(ids) >= 0 and max(ids) < num_blocks and len(set(ids)) == len(ids))


def error_header(peer: str, request_id: str | None, error: str) -> dict[str, Any]:
    """The header of the `transport_error` message a sender's own `poll()` returns."""
    return {"type": "transport_error", "peer": peer, "request_id": request_id, "error": error}


def authentic_hello(hello: Mapping[str, Any] | None, transport: str, token: str) -> bool:
    """Whether `hello` is a well-formed hello for `transport` carrying `token` (constant time)."""
    if hello is None or hello.get("type") != "hello" or hello.get("transport") != transport:
        return False
    offered, address = hello.get("token"), hello.get("address")
    if not isinstance(offered, str) or not isinstance(address, str) or len(address) > 512:
        return False
    return hmac.compare_digest(offered.encode(), token.encode())
