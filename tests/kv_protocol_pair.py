"""The transfer protocol's test harness: a prefill engine + `KVSender` and a decode engine +
`KVReceiver` in one process, joined by fake transports, and the checks the tests share."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.kv_transfer.events import TransferEvent
from tandem.kv_transfer.fake import FakeTransport
from tandem.kv_transfer.local import LocalHub
from tandem.kv_transfer.receiver import KVReceiver
from tandem.kv_transfer.sender import KVSender

TOKEN = "cluster-secret"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pair:
    """A prefill engine + sender and a decode engine + receiver joined by fake transports."""

    def __init__(
        self,
        model: str,
        decode_model: str | None = None,
        chunk_blocks: int = 8,
        hand_off: bool = False,
    ) -> None:
        self.clock = Clock()
        hub = LocalHub(TOKEN)
        self.prefill = LLM(
            model=model, num_kv_blocks=256, max_num_batched_tokens=16 * chunk_blocks
        ).engine
        self.decode = LLM(model=decode_model or model, num_kv_blocks=256).engine
        self.p_transport = FakeTransport(TOKEN, hub=hub)
        self.d_transport = FakeTransport(TOKEN, hub=hub)
        self.sender = KVSender(
            self.prefill, self.p_transport, ack_timeout_s=5, clock=self.clock, hand_off=hand_off
        )
        self.receiver = KVReceiver(
            self.decode, self.d_transport, lease_s=5, stall_timeout_s=5, clock=self.clock
        )
        self.events: list[TransferEvent] = []

    def start(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        grant = self.receiver.reserve(rid, prompt, params)
        self.sender.start(rid, prompt, params, grant)

    def pump(self, steps: int = 200) -> list[TransferEvent]:
        for _ in range(steps):
            self.events += self.sender.step()
            self.events += self.receiver.poll()
            self.events += self.sender.poll()
            idle = not self.sender.outgoing and not self.receiver.reservations
            if idle and not self.receiver.held:
                break
        return self.events

    def pump_until(self, rid: str, kind: str, timeout: float = 30.0) -> list[TransferEvent]:
        """`pump`, until `rid` has an event of `kind` (chunks may leave from another thread)."""
        deadline = time.monotonic() + timeout
        while not any(e.request_id == rid and e.kind == kind for e in self.events):
            assert time.monotonic() < deadline, f"{rid}: no {kind!r} in {timeout}s"
            self.events += self.sender.step()
            self.events += self.receiver.poll()
            self.events += self.sender.poll(timeout=0.002)
        return self.events

    def decode_all(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        while self.decode.has_unfinished_requests():
            for out in self.decode.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    def check(self) -> None:
        self.prefill.check_integrity()
        tables = [r.block_table for r in self.decode.requests.values() if r.block_table]
        self.decode.block_manager.check_integrity(tables + self.receiver.block_tables())
        for engine in (self.prefill, self.decode):
            bm = engine.block_manager
            assert all(bm.pin_count(b) == 0 for b in range(bm.num_blocks))

    def idle(self) -> None:
        """Both sides hold nothing: every block is back in the free queue."""
        self.check()
        for engine in (self.prefill, self.decode):
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint(arch="qwen3", seed=9, head_dim=32))


@pytest.fixture(scope="module")
def colocated(model: str) -> LLM:
    return LLM(model=model, num_kv_blocks=256)


def expect(colocated: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return colocated.generate([prompt], params)[0].token_ids


def prompt_of(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % 500 + 1 for i in range(n)]


def next_request_is_exact(
    pair: Pair, colocated: LLM, prompt: list[int] | None = None, rid: str = "next"
) -> None:
    prompt = prompt or prompt_of(16 * 12 + 3, start=40)
    pair.events = []
    pair.start(rid, prompt)
    events = pair.pump()
    first = next(e.token_ids for e in events if e.kind == "first_token")
    assert list(first) + pair.decode_all()[rid] == expect(colocated, prompt)
    pair.idle()
