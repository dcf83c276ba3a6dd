"""The machinery the socket-based transports share: listener, handshake, sender thread, errors.

Every endpoint listens on one control socket. To send to a peer, the endpoint's single sender
thread opens an outgoing *link*: it connects, presents ``{"type": "hello", "token": ...,
"address": <own address>}`` and waits for ``{"type": "welcome", ...}``; the listener checks the
token with `hmac.compare_digest` and answers ``{"type": "refused"}`` and closes otherwise. Frames
then flow one way, sender -> listener (``{"type": "msg", "header": {...}, ...}``); the listener
may answer on the same connection with small transport frames (e.g. staging credits), read by a
watcher thread that also notices when the peer goes away.

Send failures drop the peer's queue and come back as `transport_error` messages from the
sender's own `poll()` (see `tandem.kv_transfer.base`).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer._channel_hooks import ChannelHooks
from tandem.kv_transfer._peer_process import identity, process_ended, sender_pid
from tandem.kv_transfer._socket_channel import (
    HANDSHAKE_FRAME_LIMIT,
    Conn,
    FrameError,
    Link,
    Outgoing,
    authentic_hello,
    dst_block_ids_of,
    error_header,
    read_frame,
    request_id_of,
    send_frame,
    shutdown_and_close,
    valid_block_ids,
)
from tandem.kv_transfer.base import Message, drain_inbox, header_json
from tandem.kv_transfer.manifest import TransferError

log = logging.getLogger(__name__)

BATCH_MESSAGES = 32
"""At most this many messages to one peer are prepared before their frames are written."""
BATCH_PAGE_BYTES = 4 << 20
"""... and at most about this many bytes of their pages (bounds the delay of the first)."""
SENDER_EXIT_WAIT_S = 2.0
"""How long a connection's thread waits, after a sender's last connection ended, for its
process to have ended (then `peer_gone`)."""
YIELD_PAGE_BYTES = 512 << 10
"""`send` of at least this many bytes of pages behind others yields the GIL to the sender."""


class ChannelTransport(ChannelHooks):
    """Base of `ShmTransport` and `TorchDistTransport`; subclasses fill in the page moving.

    Subclasses set their own fields, then call ``super().__init__`` and finally `_start()`.
    Hooks run on these threads: `_accept_hello`/`_accepted`/`_receive`/`_release_conn` on the
    connection's reader thread, `_connected`/`_transmit` on the sender thread, `_back_frame` on
    the link's watcher thread, `_release_link` on whichever thread dropped the link.
    """

    def __init__(self, auth_token: str, *, timeout: float = 30.0) -> None:
        super().__init__(auth_token)
        self.timeout = float(timeout)
        self.errors: deque[TransferError] = deque(maxlen=64)
        """The most recent send failures (also reported as `transport_error` messages)."""
        self._pool: KVCachePool | None = None
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._mutex = threading.RLock()
        """`_cond`'s lock; `with self._mutex` is the cheaper way to hold it (no Python frame)."""
        self._cond = threading.Condition(self._mutex)
        self._queues: dict[str, deque[Outgoing]] = {}
        self._links: dict[str, Link] = {}
        self._conns: set[Conn] = set()
        self._open_from: dict[str, int] = {}  # authenticated connections per peer not yet ended
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._turn = 0
        self._busy_peer: str | None = None  # whose messages the sender thread holds unsent
        self._listener: socket.socket | None = None
        self._address = ""

    # ------------------------------------------------------------------- contract
    @property
    def address(self) -> str:
        return self._address

    def register_pool(self, pool: KVCachePool) -> None:
        self._pool = pool

    def send(self, peer: str, header: dict[str, Any], src_block_ids: Sequence[int] = ()) -> None:
        self._enqueue(self._outgoing(peer, header, src_block_ids))

    def _outgoing(
        self, peer: str, header: dict[str, Any], src_block_ids: Sequence[int]
    ) -> Outgoing:
        """`send`'s arguments checked and ready to queue (`TransferError` if they are not)."""
        if self._closed:
            raise TransferError("transport is closed")
        if not isinstance(peer, str) or not peer.startswith(f"{self.name}:"):
            raise TransferError(f"{self.name} transport cannot reach {peer!r}")
        ids = tuple(map(int, src_block_ids))
        if ids:
            if self._pool is None:
                raise TransferError("register_pool() before sending pages")
            if not valid_block_ids(ids, self._pool.num_blocks):
                raise TransferError(f"bad src_block_ids {list(ids)}")
        try:
            text = header_json(header)
        except (TypeError, ValueError) as exc:
            raise TransferError(f"header is not JSON-serialisable: {exc}") from None
        return Outgoing(peer, text, request_id_of(header), ids, dst_block_ids_of(header))

    def _enqueue(self, item: Outgoing) -> None:
        """Queues `item` for the sender thread and wakes it."""
        with self._cond:
            if self._closed:
                raise TransferError("transport is closed")
            queued = self._queues.setdefault(item.peer, deque())
            queued.append(item)
            page_bytes = len(item.src_block_ids) * self._block_bytes()
            busy = len(queued) > 1 and page_bytes >= YIELD_PAGE_BYTES
            self._cond.notify_all()
        if busy:
            # Let the sender thread take the GIL: a caller queueing large messages back to back
            # would otherwise hold it for a whole switch interval (5 ms) after each page copy.
            time.sleep(0)

    def poll(self, timeout: float = 0.0) -> list[Message]:
        return drain_inbox(self._inbox, timeout)

    def cancel(self, request_id: str) -> int:
        dropped = 0
        with self._cond:
            for peer, items in self._queues.items():
                kept = deque(item for item in items if item.request_id != request_id)
                dropped += len(items) - len(kept)
                self._queues[peer] = kept
        return dropped

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queues.clear()
            links = list(self._links.values())
            self._links.clear()
            conns = list(self._conns)
            self._cond.notify_all()
        shutdown_and_close(self._listener)
        for link in links:
            shutdown_and_close(link.sock)
            self._release_link(link)
        for conn in conns:
            shutdown_and_close(conn.sock)
            self._release_conn(conn)  # e.g. aborts a group a reader is blocked in
        with self._cond:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)
        self._release()

    # ------------------------------------------------------------------- threads
    def _start(self) -> None:
        self._listener, self._address = self._open_listener()
        self._spawn(self._accept_loop, "accept")
        self._spawn(self._send_loop, "send")

    def _spawn(self, target: Callable[[], None], what: str) -> None:
        thread = threading.Thread(target=target, name=f"{self.name}-kv-{what}", daemon=True)
        with self._cond:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closed:
            try:
                sock, _ = listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            conn = Conn(sock)
            with self._cond:
                if self._closed:
                    shutdown_and_close(sock)
                    return
                self._conns.add(conn)
            self._spawn(lambda conn=conn: self._serve(conn), "recv")  # type: ignore[misc]

    def _serve(self, conn: Conn) -> None:
        sock = conn.sock
        try:
            sock.settimeout(self.timeout)
            conn.rfile = rfile = sock.makefile("rb")
            hello = read_frame(rfile, HANDSHAKE_FRAME_LIMIT)
            if hello is None:  # closed before a word (a probe for stale sockets): nothing to say
                return
            if not authentic_hello(hello, self.name, self.auth_token):
                log.warning("%s: refused a connection that did not authenticate", self._address)
                send_frame(sock, {"type": "refused", "error": "authentication failed"})
                return
            assert hello is not None
            conn.peer = hello["address"]
            conn.pid = sender_pid(sock, hello)
            with self._cond:
                self._open_from[conn.peer] = self._open_from.get(conn.peer, 0) + 1
            reply = self._accept_hello(conn, hello)
            send_frame(sock, {"type": "welcome", "address": self._address, **reply})
            self._accepted(conn)
            sock.settimeout(None)
            while True:
                frame = read_frame(rfile)
                if frame is None:
                    return
                header = frame.get("header")
                if frame.get("type") != "msg":
                    self._control_frame(conn, frame)
                    continue
                if not isinstance(header, dict):
                    raise FrameError("a msg frame without a header")
                self._inbox.put(self._receive(conn, frame, header))
        except Exception as exc:  # any failure ends this connection only
            if not self._closed:
                log.info("%s: connection from %r ended: %s", self._address, conn.peer, exc)
        finally:
            with self._cond:
                self._conns.discard(conn)
            self._release_conn(conn)
            shutdown_and_close(sock)
            self._ended(conn)

    def _ended(self, conn: Conn) -> None:
        """After an authenticated connection ended and was released: when it was the peer's
        last and the peer's process has ended (`_peer_process`), a ``peer_gone`` message
        follows everything the peer sent (see `tandem.kv_transfer.base`)."""
        peer = conn.peer
        if not peer:
            return
        with self._cond:
            left = self._open_from.get(peer, 0) - 1
            if left > 0:
                self._open_from[peer] = left
                return
            self._open_from.pop(peer, None)
        ended = conn.pid is not None and process_ended(
            conn.pid, SENDER_EXIT_WAIT_S, lambda: self._closed
        )  # (a killed process's sockets close as it exits, a moment before it is a zombie)
        if ended and not self._closed:
            log.info("%s: %s is gone (its process ended)", self._address, peer)
            self._inbox.put(Message(peer, {"type": "peer_gone"}, None))

    def _next_item(self) -> Outgoing | None:
        """The next message to send, round robin over peers (call holding `_cond`); its peer is
        `_busy_peer` until the batch it starts is written."""
        peers = [peer for peer, items in self._queues.items() if items]
        if not peers:
            self._busy_peer = None
            return None
        self._turn = (self._turn + 1) % len(peers)
        self._busy_peer = peers[self._turn]
        return self._queues[self._busy_peer].popleft()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                item = self._next_item()
                while item is None and not self._closed:
                    self._cond.wait()
                    item = self._next_item()
                if self._closed or item is None:
                    return
                link = self._links.get(item.peer)
            batch = [item]
            try:
                if link is None:
                    link = self._open_link(item.peer)
                page_bytes = 0
                while True:
                    frame = self._transmit(link, item)
                    if frame is not None:
                        link.pending.append(frame)
                    page_bytes += len(item.src_block_ids) * self._block_bytes()
                    if len(batch) >= BATCH_MESSAGES or page_bytes >= BATCH_PAGE_BYTES:
                        break
                    with self._cond:
                        queued = self._queues.get(item.peer)
                        if not queued or self._closed:
                            break
                        item = queued.popleft()
                    batch.append(item)
                self._flush(link)
            except Exception as exc:  # reported to the caller through poll()
                if link is not None:
                    link.pending.clear()
                self._fail(item.peer, exc, batch, link)

    def _flush(self, link: Link) -> None:
        """Writes the frames `_transmit` returned so far (in order) in one go."""
        if link.pending:
            data = b"".join(link.pending)
            link.pending.clear()
            link.sock.sendall(data)

    def _open_link(self, peer: str) -> Link:
        sock = self._connect(peer)
        try:
            sock.settimeout(self.timeout)
            hello: dict[str, Any] = {"type": "hello", "transport": self.name}
            hello |= {"token": self.auth_token, "address": self._address, "process": identity()}
            send_frame(sock, {**hello, **self._hello_extra()})
            rfile = sock.makefile("rb")
            reply = read_frame(rfile, HANDSHAKE_FRAME_LIMIT)
            if reply is None:
                raise TransferError(f"{peer} closed the connection during the handshake")
            if reply.get("type") == "refused":
                raise TransferError(f"{peer} refused the connection: {reply.get('error')}")
            if reply.get("type") != "welcome":
                raise FrameError(f"{peer} answered the handshake with {reply.get('type')!r}")
            link = Link(peer, sock, rfile, reply)
            self._connected(link)
            sock.settimeout(None)
        except BaseException:
            shutdown_and_close(sock)
            raise
        with self._cond:
            if self._closed:
                shutdown_and_close(sock)
                raise TransferError("transport is closed")
            self._links[peer] = link
        self._spawn(lambda: self._watch(link), "watch")
        return link

    def _watch(self, link: Link) -> None:
        error: BaseException
        try:
            while True:
                frame = read_frame(link.rfile)
                if frame is None:
                    break
                self._back_frame(link, frame)
            error = TransferError(f"peer {link.peer} closed the connection")
        except Exception as exc:
            error = exc
        self._fail(link.peer, error, [], link)

    def _block_bytes(self) -> int:
        return self._pool.bytes_per_block if self._pool is not None else 0

    def _fail(
        self, peer: str, exc: BaseException, items: list[Outgoing], link: Link | None
    ) -> None:
        """Records a send failure, drops the peer's queue and link, and reports to `poll()`;
        `items` are messages taken from the queue that may not have been sent."""
        error = (
            exc if isinstance(exc, TransferError) else TransferError(f"{type(exc).__name__}: {exc}")
        )
        with self._cond:
            if self._closed:
                return
            already_failed = link is not None and link.failed
            if not items and already_failed:
                return
            lost = list(items)
            if not already_failed:
                if link is not None:
                    link.failed = True
                    if self._links.get(peer) is link:
                        del self._links[peer]
                lost.extend(self._queues.pop(peer, ()))
            self.errors.append(error)
            self._cond.notify_all()
        if link is not None and not already_failed:
            shutdown_and_close(link.sock)
            self._release_link(link)
        level = logging.WARNING if lost else logging.INFO
        log.log(level, "%s: link to %s failed: %s", self._address, peer, error)
        request_ids = list(dict.fromkeys(i.request_id for i in lost)) or [None]
        for rid in request_ids:
            self._inbox.put(Message(peer, error_header(peer, rid, str(error)), None))
