"""Workers' prefix-cache events: sequenced batches, snapshots, and hashes the router can recompute."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from tandem import LLM
from tandem.engine.block_manager import KVEvent
from tandem.engine.hashing import hash_full_blocks, root_hash
from tandem.engine.kv_event_publisher import KVEventPublisher
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_loop import WorkerLoop
from tandem.kv_transfer.local import LocalHub, LocalTransport
from tandem.prefill_workers.prefill_service import PrefillService


def test_batches_are_numbered_and_snapshots_carry_the_last_number() -> None:
    pub = KVEventPublisher("w0", "ns")
    assert pub.take_batch() is None
    pub.collect([KVEvent("stored", 11, None, 0), KVEvent("stored", 12, 11, 1)])
    first = pub.take_batch()
    assert first is not None
    assert (first["seq"], first["stored"], first["removed"], first["snapshot"]) == (
        1,
        [11, 12],
        [],
        False,
    )
    pub.collect([KVEvent("removed", 11, None, 0), KVEvent("stored", 13, 12, 2)])
    second = pub.take_batch()
    assert second is not None and (second["seq"], second["stored"], second["removed"]) == (
        2,
        [13],
        [11],
    )
    assert (second["held"], second["digest"]) == (2, 12 ^ 13)
    snap = pub.snapshot()
    assert (snap["seq"], sorted(snap["stored"]), snap["snapshot"], snap["namespace"]) == (
        3,
        [12, 13],
        True,
        "ns",
    )
    assert (snap["held"], snap["digest"]) == (2, 12 ^ 13)


def test_prefill_worker_publishes_the_prompt_block_hashes(tiny_checkpoint: Any) -> None:
    engine = LLM(model=str(tiny_checkpoint()), num_kv_blocks=64, enable_kv_events=True).engine
    service = PrefillService(engine, LocalTransport("t", hub=LocalHub("t")))
    service.start()
    prompt = list(range(20, 90))  # 4 full blocks of 16 + 6 tokens

    async def main() -> list[dict[str, Any]]:
        events = service.kv_events()
        snapshot = await anext(events)
        assert snapshot["snapshot"] and snapshot["stored"] == [] and snapshot["seq"] == 1
        service.post(
            lambda: engine.add_request(prompt, SamplingParams(max_tokens=1), request_id="a")
        )
        batches = []
        while sum(len(b["stored"]) for b in batches) < 4:
            batches.append(await asyncio.wait_for(anext(events), 10))
        await events.aclose()
        return batches

    try:
        batches = asyncio.run(main())
    finally:
        service.close()
    assert [b["seq"] for b in batches] == list(range(2, len(batches) + 2))
    expected = hash_full_blocks(engine.namespace.root_hash(), prompt, 16)
    assert [h for b in batches for h in b["stored"]] == expected
    assert all(b["namespace"] == engine.namespace.digest() for b in batches)


def test_block_hashes_do_not_depend_on_the_process_or_hash_seed() -> None:
    tokens = list(range(100))
    code = (
        "import json; from tandem.engine.hashing import hash_full_blocks, root_hash;"
        f"print(json.dumps(hash_full_blocks(root_hash('ns-digest'), {tokens!r}, 16)))"
    )
    here = hash_full_blocks(root_hash("ns-digest"), tokens, 16)
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout) == here


class _Events:
    """A block manager's event source (`drain_events`), fed by the test."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


class _IdleLoop(WorkerLoop):
    def run_once(self) -> None:
        self.wait_for_command()

    def stats(self) -> dict[str, Any]:
        return {}

    def on_death(self, exc: BaseException) -> None:
        pass


class _Inline:
    """An event loop that runs `call_soon_threadsafe` callbacks at once."""

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        fn(*args)


def test_a_loop_going_idle_publishes_what_its_last_step_cached_at_once() -> None:
    """A conversation's next turn comes right after the last one's end: the blocks that end
    cached go to the router before the loop sleeps, not after its idle wait (the next turn
    was routed without them and missed the decode worker holding its prefix)."""
    loop = _IdleLoop("w0")
    source = _Events()
    loop.publish_kv_events(source, "ns")  # type: ignore[arg-type]
    received: list[dict[str, Any]] = []
    loop._kv_subscribers.append((_Inline(), SimpleNamespace(put_nowait=received.append)))  # type: ignore[arg-type]
    loop._flush_kv_events(force=True)  # a batch just went: the next waits KV_EVENTS_INTERVAL_S
    assert received == []  # (nothing was cached yet: no batch, and no periodic snapshot)
    source.events = [KVEvent("stored", 7, None, 0)]  # the last step cached a block
    loop._flush_kv_events()  # (the loop's flush after the step: too soon after the last)
    assert received == []
    loop.wait_for_command(timeout=0.0)  # going idle
    assert [b["stored"] for b in received] == [[7]]
