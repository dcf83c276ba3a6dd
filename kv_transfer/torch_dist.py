"""torch.distributed transport: JSON headers on a control socket, pages on a pairwise group.

Address: ``torch:<host>:<port>`` (a TCP control listener, `_channel_transport`; port 0 by
default, so the OS picks one outside Ray's 10002-19999 range).

No global ``init_process_group``: every link (one sending direction between two endpoints) gets
its own two-rank process group, formed after the control handshake has authenticated the peer.
The listener (rank 0, receiving) starts a `TCPStore` on an ephemeral port and answers the
handshake with that port, a random key prefix and the backend; both sides then build the group
on ``PrefixStore(prefix, store)``. The store listens on every interface (torch offers no bind
address); the secret prefix keeps anyone who did not authenticate from joining the rendezvous.

Backend: NCCL when `torch.distributed.is_nccl_available()` and both pools are on CUDA, on two
different GPUs; gloo otherwise (CUDA pages then travel through host memory). NCCL refuses two
ranks on one GPU, which is what a prefill and a decode worker sharing a GPU would be.

Per message with pages, the sender sends the header frame announcing the page shape and dtype,
then ``group.send`` of the pages (a view of the pool when the source ids are one consecutive run,
else a gathered copy). The receiver ``recv``s straight into its pool when the header's
``manifest.dst_block_ids`` are one consecutive run matching the pool (``header["direct"]`` is
True, `Message.pages` None), else into a new tensor returned as `Message.pages`.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.kv_transfer._channel_transport import ChannelTransport
from tandem.kv_transfer._socket_channel import (
    Conn,
    FrameError,
    Link,
    Outgoing,
    consecutive_runs,
    dst_block_ids_of,
    dtype_name,
    encode_frame,
    parse_dtype,
    parse_shape,
    valid_block_ids,
)
from tandem.kv_transfer.base import Message
from tandem.kv_transfer.manifest import TransferError

MAX_MESSAGE_BYTES = 8 << 30
"""The largest page payload a receiver accepts in one message."""
_TAG = 0


@dataclass(eq=False)
class _Pair:
    """One side of a two-rank group: the store it was formed on, the group and its backend."""

    backend: str
    store: Any = None
    prefix: str = ""
    group: Any = None


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("torch:").rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"bad torch transport address {address!r}")
    return host.strip("[]"), int(port)


class TorchDistTransport(ChannelTransport):
    """Pages over pairwise torch.distributed groups (see the module docstring).

    Options: `host` (control listener bind address, default loopback), `port` (default 0),
    `advertise_host` (the host peers should dial and gloo binds to; default `host`), `timeout`
    (seconds for connect, handshake, group formation and each page transfer).
    """

    name = "torch"

    def __init__(
        self,
        auth_token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(auth_token, timeout=timeout)
        self._host = host
        self._port = int(port)
        self._advertise = advertise_host or host
        self._start()

    # ------------------------------------------------------------------- groups
    def _nccl_capable(self) -> bool:
        pool = self._pool
        return bool(pool is not None and pool.device.type == "cuda" and dist.is_nccl_available())

    def _gpu_id(self) -> str | None:
        """The pool's GPU as the driver names it (its UUID), the same in every process."""
        pool = self._pool
        if pool is None or pool.device.type != "cuda":
            return None
        uuid = getattr(torch.cuda.get_device_properties(pool.device), "uuid", None)
        return str(uuid) if uuid is not None else None

    def _make_group(self, store: Any, prefix: str, rank: int, backend: str) -> Any:
        prefixed = dist.PrefixStore(prefix, store)
        timeout = datetime.timedelta(seconds=self.timeout)
        if backend == "nccl":
            nccl: Any = dist.ProcessGroupNCCL  # only on CUDA builds
            options = nccl.Options()
            options._timeout = timeout
            return nccl(prefixed, rank, 2, options)
        gloo: Any = dist.ProcessGroupGloo
        options = gloo._Options()
        options._devices = [gloo.create_device(hostname=self._advertise)]
        options._timeout = timeout
        return gloo(prefixed, rank, 2, options)

    def _recv_device(self, backend: str) -> torch.device:
        pool = self._pool
        if backend == "nccl" and pool is not None:
            return pool.device
        return torch.device("cpu")

    # ------------------------------------------------------------- connections
    def _open_listener(self) -> tuple[socket.socket, str]:
        listener = socket.create_server((self._host, self._port), backlog=64)
        port = listener.getsockname()[1]
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return listener, f"torch:{host}:{port}"

    def _connect(self, peer: str) -> socket.socket:
        sock = socket.create_connection(_split_host_port(peer), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _hello_extra(self) -> dict[str, Any]:
        capable = self._nccl_capable()
        return {"cuda": capable, "gpu": self._gpu_id() if capable else None}

    def _accept_hello(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        own_gpu = self._gpu_id()
        same_gpu = own_gpu is not None and hello.get("gpu") == own_gpu
        nccl = hello.get("cuda") is True and self._nccl_capable() and not same_gpu
        backend = "nccl" if nccl else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout)
        store = dist.TCPStore(self._advertise, 0, 2, True, timeout, wait_for_workers=False)
        prefix = secrets.token_hex(16)
        conn.state = _Pair(backend, store, prefix)
        return {"store_port": store.port, "prefix": prefix, "backend": backend}

    def _accepted(self, conn: Conn) -> None:
        pair: _Pair = conn.state
        pair.group = self._make_group(pair.store, pair.prefix, 0, pair.backend)

    def _connected(self, link: Link) -> None:
        welcome = link.welcome
        port, prefix, backend = (
            welcome.get("store_port"),
            welcome.get("prefix"),
            welcome.get("backend"),
        )
        if (
            not isinstance(port, int)
            or not isinstance(prefix, str)
            or backend not in ("gloo", "nccl")
        ):
            raise FrameError(f"{link.peer} sent a bad welcome {welcome!r}")
        if backend == "nccl" and not self._nccl_capable():
            raise TransferError(f"{link.peer} chose nccl, which this endpoint cannot use")
        host, _ = _split_host_port(link.peer)
        timeout = datetime.timedelta(seconds=self.timeout)
        store = dist.TCPStore(host, port, 2, False, timeout)
        link.state = _Pair(backend, store, prefix, self._make_group(store, prefix, 1, backend))

    @staticmethod
    def _drop_pair(pair: object) -> None:
        if isinstance(pair, _Pair):
            group, pair.group, pair.store = pair.group, None, None
            if group is not None:
                with contextlib.suppress(Exception):  # best effort: half-formed or gone
                    group.abort()

    def _release_link(self, link: Link) -> None:
        self._drop_pair(link.state)

    def _release_conn(self, conn: Conn) -> None:
        self._drop_pair(conn.state)

    # ------------------------------------------------------------------ sending
    def _transmit(self, link: Link, item: Outgoing) -> bytes | None:
        pool = self._pool
        src = item.src_block_ids
        if not src or pool is None:
            link.sock.sendall(encode_frame(f'{{"type":"msg","header":{item.header_json}}}'))
            return None
        pair: _Pair = link.state
        runs = consecutive_runs(src, range(len(src)))
        pages = (
            pool.tensor[src[0] : src[0] + len(src)] if len(runs) == 1 else pool.export_blocks(src)
        )
        pages = pages.to("cpu" if pair.backend == "gloo" else pool.device)
        meta = f'{{"shape":{list(pages.shape)},"dtype":"{dtype_name(pages.dtype)}"}}'
        link.sock.sendall(
            encode_frame(f'{{"type":"msg","pages":{meta},"header":{item.header_json}}}')
        )
        group = pair.group
        if group is None:
            raise TransferError(f"link to {link.peer} is closed")
        group.send([pages], 0, _TAG).wait()
        return None

    # ---------------------------------------------------------------- receiving
    def _receive(self, conn: Conn, frame: dict[str, Any], header: dict[str, Any]) -> Message:
        meta = frame.get("pages")
        if meta is None:
            return Message(conn.peer, header, None)
        if not isinstance(meta, dict):
            raise FrameError(f"bad pages {meta!r}")
        dtype = parse_dtype(meta.get("dtype"))
        shape = parse_shape(meta.get("shape"), 6)
        nbytes = torch.empty((), dtype=dtype).element_size()
        for dim in shape:
            nbytes *= dim
        if nbytes > MAX_MESSAGE_BYTES:
            raise FrameError(f"refusing {nbytes} bytes of pages in one message")
        pair: _Pair = conn.state
        group = pair.group
        if group is None:
            raise TransferError("connection is closed")
        device = self._recv_device(pair.backend)
        target = self._direct_target(header, shape, dtype)
        if target is not None and target.device == device:
            group.recv([target], 1, _TAG).wait()
        else:
            pages = torch.empty(shape, dtype=dtype, device=device)
            group.recv([pages], 1, _TAG).wait()
            if target is None:
                header["direct"] = False
                return Message(conn.peer, header, pages)
            target.copy_(pages)
        header["direct"] = True
        return Message(conn.peer, header, None)

    def _direct_target(
        self, header: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The pool slice the pages go to, when the dst ids are one run matching the pool."""
        pool = self._pool
        dst = dst_block_ids_of(header)
        if pool is None or dst is None or not dst or len(dst) != shape[0]:
            return None
        if shape[1:] != pool.block_shape or dtype != pool.dtype:
            return None
        if not valid_block_ids(dst, pool.num_blocks) or dst[-1] - dst[0] != len(dst) - 1:
            return None
        if len(consecutive_runs(dst, dst)) != 1:
            return None
        return pool.tensor[dst[0] : dst[0] + len(dst)]
