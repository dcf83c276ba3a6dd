"""What a refused chunk leaves behind. shm, torch and ucx write a chunk's pages where its
manifest says before the receiver reads it: a chunk that names another request's blocks
wrote into them, and that request went on decoding the wrong pages (found by a prober: V
decoded [462, 258, ...] for [462, 432, ...]). Now the requests holding such blocks fail and
the blocks leave the prefix cache. A last chunk with first tokens the model does not have, or
a sampler state no generator takes, is refused (it raised out of `poll` and leaked the
reservation's blocks); a closed transport does not make `poll` raise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter
from tests import kv_protocol_pair
from tests.kv_protocol_pair import GREEDY, Pair, next_request_is_exact, prompt_of

model = kv_protocol_pair.model  # the module-scoped fixtures
colocated = kv_protocol_pair.colocated


def _send_chunk(pair: Pair, rid: str, dst: list[int], *, direct: bool, **fields: Any) -> None:
    """A sender with the cluster token sends chunk `fields.get("chunk_index", 0)` of `rid`
    for `dst`: written there at once as a direct transport writes (`direct`), else staged."""
    layout = KVLayout.of_pool(pair.decode.kv_pool, pair.decode.namespace.digest())
    fields = {"chunk_index": 0, "last": False, "num_tokens": 16 * len(dst), **fields}
    index = fields.pop("chunk_index")
    header = dict(
        PagesHeaderWriter(layout).write(rid, index, src_block_ids=dst, dst_block_ids=dst, **fields)
    )
    pool = pair.decode.kv_pool
    if direct:
        junk = torch.full(pool.blocks_shape(len(dst)), 7.0, dtype=pool.dtype)
        pool.import_blocks(dst, junk)
        header["direct"] = True
        pair.p_transport.send(pair.d_transport.address, header)
    else:
        pair.p_transport.send(pair.d_transport.address, header, dst)


def _kinds(events: list[Any], rid: str) -> list[str]:
    return [e.kind for e in events if e.request_id == rid]


def test_a_chunk_written_into_a_running_requests_blocks_fails_that_request(
    model: str, colocated: LLM
) -> None:
    pair = Pair(model)
    victim = prompt_of(16 * 6, start=3)
    pair.start("v", victim)
    assert "committed" in _kinds(pair.pump(), "v")
    v_blocks = list(pair.decode.requests["v"].block_table)
    grant = pair.receiver.reserve("x", prompt_of(16 * 2, start=90), GREEDY)
    assert not set(grant.dst_block_ids) & set(v_blocks)
    pair.events = []
    _send_chunk(pair, "x", v_blocks[:2], direct=True)
    events = pair.receiver.poll()
    assert _kinds(events, "x") == ["failed"] and _kinds(events, "v") == ["failed"]
    failed_v = next(e for e in events if e.request_id == "v")
    assert "overwritten by a refused chunk of x" in (failed_v.error or "")
    assert "v" not in pair.decode.requests
    assert all(pair.decode.block_manager.cached_hash(b) is None for b in v_blocks[:2])
    pair.clock.now += 10  # (x's blocks are held until its sender stops, or the stall timeout)
    pair.receiver.poll()
    pair.idle()
    next_request_is_exact(pair, colocated)


def test_a_refused_chunk_written_into_cached_blocks_takes_them_out_of_the_cache(
    model: str, colocated: LLM
) -> None:
    """A chunk for no live reservation wrote blocks of a finished request's cached prefix:
    the next request with that prefix computes it again (it read the overwritten pages)."""
    pair = Pair(model)
    prompt = prompt_of(16 * 6, start=4)
    pair.start("w", prompt)
    pair.pump()
    pair.decode_all()
    cached = [b for b in range(pair.decode.block_manager.num_blocks)
              if pair.decode.block_manager.cached_hash(b) is not None]  # fmt: skip
    assert len(cached) >= 6
    _send_chunk(pair, "gone", cached[:3], direct=True)
    assert pair.receiver.poll() == []
    assert all(pair.decode.block_manager.cached_hash(b) is None for b in cached[:3])
    next_request_is_exact(pair, colocated, prompt, "again")


def test_a_chunk_sent_again_for_other_blocks_fails_its_request(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    grant = pair.receiver.reserve("d", prompt_of(16 * 4, start=5), GREEDY)
    first, second = grant.dst_block_ids[:2], grant.dst_block_ids[2:]
    _send_chunk(pair, "d", first, direct=False, num_tokens=32)
    assert pair.receiver.poll() == []
    _send_chunk(pair, "d", second, direct=True, num_tokens=32)  # (chunk 0 again)
    events = pair.receiver.poll()
    assert _kinds(events, "d") == ["failed"]
    assert "came again for blocks" in (events[0].error or "")
    pair.clock.now += 10
    pair.receiver.poll()
    pair.idle()


def test_a_last_chunk_the_engine_cannot_take_is_refused(model: str, colocated: LLM) -> None:
    pair = Pair(model)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    vocab = pair.decode.spec.vocab_size
    cases = [({"first_token_ids": [vocab]}, "are not all in [0,"),
             ({"first_token_ids": [-5]}, "are not all in [0,"),
             ({"first_token_ids": [5], "sampler_state": "AAAA"}, "could not commit"),
             ({"first_token_ids": [5], "sampler_state": "%%"}, "could not commit")]  # fmt: skip
    for i, (fields, why) in enumerate(cases):
        rid = f"bad{i}"
        grant = pair.receiver.reserve(rid, prompt_of(16 * 2, start=6 + i), sampled)
        _send_chunk(pair, rid, grant.dst_block_ids, direct=False, last=True, **fields)
        events = pair.receiver.poll()
        assert _kinds(events, rid) == ["failed"] and why in (events[0].error or ""), events
        pair.clock.now += 10
        pair.receiver.poll()
        pair.idle()
    next_request_is_exact(pair, colocated)


def test_poll_on_a_closed_transport_returns_the_stalled_transfer(model: str) -> None:
    """Telling the sender failed (the transport is closed): the event still comes."""
    pair = Pair(model)
    pair.receiver.reserve("late", prompt_of(16 * 2, start=7), GREEDY)
    _send_chunk(pair, "late", pair.receiver.reservations["late"].block_table[:1], direct=False,
                num_tokens=16)  # fmt: skip
    assert pair.receiver.poll() == []  # (taken, acknowledged)
    pair.d_transport.close()
    pair.clock.now += 10
    events = pair.receiver.poll()
    assert _kinds(events, "late") == ["failed"]


@pytest.mark.parametrize("step", ["chunk_problem", "commit_request"])
def test_a_message_whose_handling_raises_fails_its_request_and_polling_goes_on(
    model: str, colocated: LLM, monkeypatch: Any, step: str
) -> None:
    """A defect handling one chunk (its checks, or the last chunk's commit, raise) fails the
    reservation it names; `poll` does not raise (it used to end the decode worker's loop, and
    every request on it), and the blocks come back (a commit that raised had leaked them)."""
    from tandem.kv_transfer import receiver

    pair = Pair(model)
    real = getattr(receiver, step)
    calls = {"n": 0}

    def breaks_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("a defect")
        return real(*args, **kwargs)

    monkeypatch.setattr(receiver, step, breaks_once)
    pair.start("x", prompt_of(16 * 20, start=5))
    events = pair.pump()
    errors = [e.error or "" for e in events if e.request_id == "x" and e.kind == "failed"]
    assert len(errors) == 2  # (decode's, and its sender's on decode's word)
    assert "internal error on its KV message: KeyError" in errors[0]
    assert "x" not in pair.receiver.reservations and "x" not in pair.decode.requests
    pair.clock.now += 10  # (its blocks are held until its sender stops, or the stall timeout)
    pair.pump()
    pair.idle()
    next_request_is_exact(pair, colocated)
