"""A prefill process and a decode process joined by a real KV transport (tests, benchmarks).

Each process runs its engine and its half of the protocol in a loop and talks to its owner over a
multiprocessing pipe; the owner plays the router (reserve on decode, start on prefill). The pipe
is local IPC between processes this module starts, never a network connection.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

TOKEN = "two-process-token"


def _stamped(event: Any, **extra: Any) -> dict[str, Any]:
    """The event as a dict with `at`: when this process saw it (`time.perf_counter()`, one
    clock for every process of the machine, so owners can time hops between processes)."""
    return {**event._asdict(), "at": time.perf_counter(), **extra}


def _setup(
    model: str,
    transport_name: str,
    options: dict[str, Any],
    threads: int,
    *,
    send_only: bool = False,
    **llm_kwargs: Any,
) -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(threads)
    from tandem import LLM
    from tandem.kv_transfer.registry import create_transport, pool_factory

    transport = create_transport(transport_name, TOKEN, **options)
    factory = pool_factory(transport, send_only=send_only)  # (send_only: as a prefill worker's)
    engine = LLM(model=model, num_kv_blocks=256, kv_pool_factory=factory, **llm_kwargs).engine
    return engine, transport


def decode_main(
    conn: Connection,
    model: str,
    transport_name: str,
    options: dict[str, Any],
    threads: int,
    lease_s: float = 10.0,
    stall_timeout_s: float = 3.0,
    device: str = "cpu",
) -> None:
    from tandem.engine.sampling_params import SamplingParams
    from tandem.kv_transfer.receiver import KVReceiver

    engine, transport = _setup(model, transport_name, options, threads, device=device)
    receiver = KVReceiver(engine, transport, lease_s=lease_s, stall_timeout_s=stall_timeout_s)
    conn.send(("ready", transport.address))
    tokens: dict[str, list[int]] = {}
    # What to do once a request's first chunk has arrived (so the sender is known), or its
    # reservation ended: "cancel" (a decode-side cancel mid-stream) or "tell_streaming" (an event)
    once_streaming: dict[str, str] = {}
    try:
        while True:
            for rid, action in list(once_streaming.items()):
                res = receiver.reservations.get(rid)
                if res is not None and res.peer is None:
                    continue
                del once_streaming[rid]
                if action == "cancel":
                    receiver.cancel(rid)
                else:
                    streaming = {"kind": "streaming", "request_id": rid, "ok": res is not None}
                    conn.send(("event", streaming))
            if conn.poll():
                cmd, *args = conn.recv()
                if cmd == "stop":
                    break
                if cmd in ("cancel", "tell_streaming"):
                    once_streaming[args[0]] = cmd
                if cmd == "reserve":
                    rid, prompt, params = args
                    conn.send(
                        ("grant", receiver.reserve(rid, prompt, SamplingParams(**params))._asdict())
                    )
                if cmd == "check":
                    tables = [r.block_table for r in engine.requests.values() if r.block_table]
                    engine.block_manager.check_integrity(tables + receiver.block_tables())
                    conn.send(
                        (
                            "checked",
                            engine.block_manager.num_free_blocks,
                            engine.block_manager.num_blocks,
                        )
                    )
            for event in receiver.poll(timeout=0.002):
                conn.send(("event", _stamped(event)))
            if engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finished:
                        conn.send(("done", out.request_id, tokens.pop(out.request_id)))
    finally:
        transport.close()


def prefill_main(
    conn: Connection,
    model: str,
    transport_name: str,
    options: dict[str, Any],
    threads: int,
    chunk_blocks: int,
    checksums: bool,
    hand_off: bool = True,
    device: str = "cpu",
) -> None:
    from tandem.engine.sampling_params import SamplingParams
    from tandem.kv_transfer.manifest import KVLayout
    from tandem.kv_transfer.receiver import ReservationGrant
    from tandem.kv_transfer.sender import KVSender

    engine, transport = _setup(
        model,
        transport_name,
        options,
        threads,
        send_only=True,
        max_num_batched_tokens=16 * chunk_blocks,
        device=device,
    )
    sender = KVSender(engine, transport, checksums=checksums, ack_timeout_s=10, hand_off=hand_off)
    conn.send(("ready", transport.address))
    # The engine thread's wall time minus its CPU time in steps: time it was runnable but did
    # not run (waiting for the GIL held by another thread of this process, or preempted).
    stalled = 0.0
    try:
        while True:
            if conn.poll():
                cmd, *args = conn.recv()
                if cmd == "stop":
                    break
                if cmd == "layout":  # tests: pretend to be another model (None: back to own)
                    own = KVLayout.of_pool(engine.kv_pool, engine.namespace.digest())
                    sender.layout = own.model_copy(update={"namespace": args[0] or own.namespace})
                if cmd == "check":
                    engine.check_integrity()
                    bm = engine.block_manager
                    pinned = sum(bm.pin_count(b) > 0 for b in range(bm.num_blocks))
                    conn.send(("checked", bm.num_free_blocks, bm.num_blocks, pinned))
                if cmd == "start":  # grant None: prefill only (pages wait; "cancel" ends it)
                    rid, prompt, params, grant = args
                    grant = ReservationGrant(**grant) if grant is not None else None
                    sender.start(rid, prompt, SamplingParams(**params), grant)
                if cmd == "cancel":
                    sender.cancel(args[0])
            if engine.has_unfinished_requests():
                wall, cpu = time.perf_counter(), time.thread_time()
                first_tokens = sender.compute()
                stalled += time.perf_counter() - wall - (time.thread_time() - cpu)
                for event in first_tokens:  # out before the last pages go
                    conn.send(
                        (
                            "event",
                            _stamped(event, send_work_s=sender.send_work_s, stall_s=stalled),
                        )
                    )
                events = sender.stream()
            else:
                events = sender.poll(timeout=0.002)
            for event in events:
                conn.send(("event", _stamped(event, send_work_s=sender.send_work_s)))
    finally:
        sender.close()
        transport.close()


class PDProcesses:
    """Starts both processes; `run(rid, prompt, params)` returns first token + decoded tokens.
    `devices` is where each engine runs, (prefill, decode): "cpu" or "cuda"."""

    def __init__(
        self,
        model: str,
        transport: str,
        options: dict[str, Any] | None = None,
        chunk_blocks: int = 8,
        threads: int = 1,
        checksums: bool = True,
        lease_s: float = 10.0,
        stall_timeout_s: float = 3.0,
        hand_off: bool = True,
        devices: tuple[str, str] = ("cpu", "cpu"),
    ) -> None:
        ctx = mp.get_context("spawn")
        self.decode_conn, d_child = ctx.Pipe()
        self.prefill_conn, p_child = ctx.Pipe()
        opts = options or {}
        self.decode = ctx.Process(
            target=decode_main,
            args=(d_child, model, transport, opts, threads, lease_s, stall_timeout_s, devices[1]),
            daemon=True,
        )
        self.prefill = ctx.Process(
            target=prefill_main,
            args=(
                p_child,
                model,
                transport,
                opts,
                threads,
                chunk_blocks,
                checksums,
                hand_off,
                devices[0],
            ),
            daemon=True,
        )
        self.decode.start()
        self.prefill.start()
        self.decode_address = self._expect(self.decode_conn, "ready")[1]
        self.prefill_address = self._expect(self.prefill_conn, "ready")[1]
        self.events: list[dict[str, Any]] = []

    @staticmethod
    def _expect(conn: Connection, kind: str, timeout: float = 60.0) -> tuple[Any, ...]:
        if not conn.poll(timeout):
            raise TimeoutError(f"no {kind!r} from the worker process in {timeout}s")
        msg = conn.recv()
        if msg[0] != kind:
            raise AssertionError(f"expected {kind!r}, got {msg!r}")
        return tuple(msg)

    def reserve(self, rid: str, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Reserves on the decode side only; returns the grant as a dict."""
        self.decode_conn.send(("reserve", rid, prompt, params))
        return dict(self._expect(self.decode_conn, "grant")[1])

    def start(self, rid: str, prompt: list[int], params: dict[str, Any]) -> None:
        grant = self.reserve(rid, prompt, params)
        self.prefill_conn.send(("start", rid, prompt, params, grant))

    def prefill_only(self, rid: str, prompt: list[int], params: dict[str, Any]) -> None:
        """Prefill on the prefill side with no reservation (nothing is sent); end it with
        `cancel_prefill` once its first token is out."""
        self.prefill_conn.send(("start", rid, prompt, params, None))

    def wait_streaming(self, rid: str, timeout: float = 30.0) -> bool:
        """Until the decode side has the first chunk of `rid` (True), or no longer holds its
        reservation (False)."""
        self.decode_conn.send(("tell_streaming", rid))
        return bool(self.wait_event(self.decode_conn, "streaming", rid, timeout)["ok"])

    def cancel_prefill(self, rid: str) -> None:
        self.prefill_conn.send(("cancel", rid))

    def run(
        self, rid: str, prompt: list[int], params: dict[str, Any], timeout: float = 60.0
    ) -> list[int]:
        self.start(rid, prompt, params)
        first: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for conn in (self.prefill_conn, self.decode_conn):
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "event":
                        self.events.append(msg[1])
                        if msg[1]["kind"] == "first_token" and msg[1]["request_id"] == rid:
                            first = list(msg[1]["token_ids"])
                        if msg[1]["kind"] == "failed" and msg[1]["request_id"] == rid:
                            raise AssertionError(f"transfer failed: {msg[1]['error']}")
                    elif msg[0] == "done" and msg[1] == rid:
                        return first + list(msg[2])
            time.sleep(0.002)
        raise TimeoutError(f"request {rid} did not finish in {timeout}s")

    def wait_event(
        self, conn: Connection, kind: str, rid: str, timeout: float = 30.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                msg = conn.recv()
                if msg[0] == "event":
                    self.events.append(msg[1])
                    if msg[1]["kind"] == kind and msg[1]["request_id"] == rid:
                        return dict(msg[1])
        raise TimeoutError(f"no {kind} event for {rid} in {timeout}s")

    def check_prefill(self) -> tuple[int, int, int]:
        """Integrity check in the prefill process: (free blocks, blocks, pinned blocks)."""
        self.prefill_conn.send(("check",))
        while True:
            msg = self.prefill_conn.recv()
            if msg[0] == "checked":
                return int(msg[1]), int(msg[2]), int(msg[3])
            if msg[0] == "event":
                self.events.append(msg[1])

    def check_decode(self) -> tuple[int, int]:
        self.decode_conn.send(("check",))
        while True:
            msg = self.decode_conn.recv()
            if msg[0] == "checked":
                return int(msg[1]), int(msg[2])
            if msg[0] == "event":
                self.events.append(msg[1])

    def wait_settled(self, timeout: float = 15.0) -> None:
        """Until both sides pass their integrity checks holding nothing: every decode block
        free, every prefill block free and none pinned (TimeoutError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            free, total = self.check_decode()
            p_free, p_total, pinned = self.check_prefill()
            if (free, p_free, pinned) == (total, p_total, 0):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode {free}/{total} free, prefill {p_free}/{p_total} "
                                   f"free with {pinned} pinned")  # fmt: skip
            time.sleep(0.1)

    def close(self) -> None:
        for conn, proc in ((self.prefill_conn, self.prefill), (self.decode_conn, self.decode)):
            if proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(("stop",))
                proc.join(10)
            if proc.is_alive():
                proc.kill()
