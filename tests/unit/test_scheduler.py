"""The scheduler's one rule on tiny configs: exact budgets, block ids, order and preemption."""

from __future__ import annotations

import pytest

from tandem.engine import scheduler as scheduler_module
from tandem.engine.block_manager import BlockManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerOutput

PARAMS = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


def make(
    num_blocks: int = 8, budget: int = 64, max_seqs: int = 8, prefix: bool = True
) -> Scheduler:
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=prefix)
    return Scheduler(
        bm,
        root_hash=123,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_prefix_caching=prefix,
    )


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), PARAMS, frozenset())


def run_step(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Pretend the model ran: credit tokens and append one sampled token where due."""
    s.advance(out)
    for r, _ in out.scheduled:
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(token)
            r.set_status(RequestStatus.DECODING)


def check(s: Scheduler) -> None:
    s.block_manager.check_integrity([r.block_table for r in s.running if r.block_table])


def test_chunked_prefill_fills_the_budget_and_decode_goes_first() -> None:
    s = make(num_blocks=16, budget=6)
    a, b = req("a", 5), req("b", 9, start=100)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 1)]
    assert out.num_batched_tokens == 6
    assert a.block_table == [0, 1] and b.block_table == [2]
    run_step(s, out)
    out = s.schedule()  # a decodes first, b's prefill gets the rest of the budget
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 5)]
    assert b.block_table == [2, 3]
    run_step(s, out)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 3)]
    check(s)


def test_max_num_seqs_caps_admission() -> None:
    s = make(num_blocks=16, budget=100, max_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 3, start=10 * i))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]
    assert s.waiting[0].status == RequestStatus.QUEUED
    check(s)


def test_prefix_hit_on_full_blocks_leaves_one_token_to_compute() -> None:
    s = make(num_blocks=16, budget=100)
    a = req("a", 8)
    s.add(a)
    out = s.schedule()
    run_step(s, out)
    assert a.block_table == [0, 1]  # 8 prompt tokens; the 9th gets its block when scheduled
    b = req("b", 8)  # same 8 tokens: 2 full blocks, but one token must be computed
    s.add(b)
    out = s.schedule()
    assert ("b", 4) in [(r.request_id, n) for r, n in out.scheduled]
    assert b.block_table[:1] == [0] and b.num_prefix_hit_tokens == 4
    c = req("c", 10)  # 0..9: blocks [0..3], [4..7] hit; 2 tokens computed
    s.add(c)
    out = s.schedule()
    assert ("c", 2) in [(r.request_id, n) for r, n in out.scheduled]
    assert c.block_table[:2] == [0, 1] and c.num_prefix_hit_tokens == 8
    check(s)


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    s = make(num_blocks=4, budget=100)
    a, b = req("a", 4), req("b", 4, start=50)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert a.block_table == [0] and b.block_table == [1]
    run_step(s, out)  # both now have 5 tokens, each needs a second block
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    assert a.block_table == [0, 2] and b.block_table == [1, 3]
    run_step(s, out)
    for _ in range(3):  # fill the second blocks
        run_step(s, s.schedule())
    assert a.num_tokens == 9 and a.num_computed_tokens == 8
    out = s.schedule()  # a needs a third block: b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert b.status == RequestStatus.QUEUED and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b and b.num_preemptions == 1 and s.num_preemptions == 1
    assert a.block_table == [0, 2, 3]
    check(s)


def test_a_preempted_request_waits_behind_more_urgent_ones() -> None:
    """Requeued first of its own priority: ahead of it go only waiting requests of a higher
    one (lower value), as vLLM's priority queue puts it back; it went before all of them."""
    s = make(num_blocks=4, budget=100, max_seqs=2)
    a, b = req("a", 4), req("b", 4, start=50)
    b.priority = 3
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())
    urgent, same, later = req("u", 4, start=80), req("s", 4, start=90), req("l", 4, start=99)
    urgent.priority, same.priority, later.priority = 0, 3, 5
    for r in (urgent, same, later):
        s.add(r)  # (max_seqs=2: they wait)
    for _ in range(5):  # a and b fill their second blocks; a then needs a third
        out = s.schedule()
        run_step(s, out)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r in s.waiting] == ["u", "b", "s", "l"]
    check(s)


def test_a_request_whose_pages_go_to_decode_gets_its_whole_prompt_and_is_not_preempted() -> None:
    # (a prefill engine: the pages a transfer sent stay pinned until decode acknowledges the
    # last chunk, so preempting such a request frees none of them, and asking for blocks
    # mid-prefill could wait forever on another one's)
    s = make(num_blocks=6, budget=4)
    c = Request("c", list(range(50, 62)), PARAMS, frozenset(), keep_kv=True)
    s.add(c)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("c", 4)]
    assert c.block_table == [0, 1, 2]  # the whole 12-token prompt's blocks, at admission
    a = req("a", 7, start=100)
    s.add(a)
    run_step(s, out)
    s.schedule()  # (c's next chunk uses the budget: a waits)
    assert a.block_table == [] and c.block_table == [0, 1, 2]
    check(s)


def test_a_decode_short_of_blocks_passes_over_a_request_whose_pages_go_to_decode() -> None:
    s = make(num_blocks=4, budget=2)
    d = req("d", 4)
    s.add(d)
    run_step(s, s.schedule())
    run_step(s, s.schedule())  # d's prompt is in; it decodes from now on
    e = Request("e", list(range(60, 68)), PARAMS, frozenset(), keep_kv=True)
    s.add(e)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("d", 1), ("e", 1)]
    assert d.block_table == [0, 1] and e.block_table == [2, 3]  # the pool is full
    for _ in range(4):  # d decodes on until its 8 slots are full
        assert not out.preempted
        run_step(s, out)
        out = s.schedule()
    # d needs a third block: e, newest, streams its pages (pinned until decode acknowledges
    # them), so d gives way instead
    assert [r.request_id for r in out.preempted] == ["d"]
    assert e.block_table == [2, 3] and e.num_computed_tokens < 8
    check(s)


def test_lifecycle_timestamps_in_order() -> None:
    s = make()
    a = req("a", 3)
    s.add(a)
    run_step(s, s.schedule())
    stamps = a.timestamps
    assert list(stamps)[:5] == [
        RequestStatus.NEW,
        RequestStatus.QUEUED,
        RequestStatus.PREFIX_LOOKUP,
        RequestStatus.PREFILLING,
        RequestStatus.DECODING,
    ]
    values = list(stamps.values())
    assert values == sorted(values)
    s.remove(a)
    assert s.block_manager.num_free_blocks == 8


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    from tandem.engine.block_manager import BlockManager
    from tandem.engine.request import Request
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(64, 4), 0, max_num_batched_tokens=8, max_num_seqs=8)
    reqs = [
        Request(name, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), frozenset(), priority=prio)
        for name, prio in (("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 0))
    ]
    for r in reqs:
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == ["c", "a", "e", "b", "d"]
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["c"]


def test_two_half_prefilled_prompts_short_of_blocks_do_not_wait_for_each_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill chunk with no block left preempts the newest running prompt after it (vLLM's
    rule): two prompts that each held half the pool and waited for the other's blocks made
    every step empty, forever. (`a` asks prompt logprobs: its chunks are capped, so `b` is
    admitted beside it.)"""
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", 4)
    s = make(num_blocks=8, budget=8, prefix=False)
    logprobs = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, prompt_logprobs=0)
    a = Request("a", list(range(20)), logprobs, frozenset())  # 5 blocks
    b = req("b", 24, start=100)  # 6 blocks: not both in 8
    s.add(a)
    s.add(b)
    steps = []
    for _ in range(6):
        out = s.schedule()
        steps.append(
            ([(r.request_id, n) for r, n in out.scheduled], [v.request_id for v in out.preempted])
        )
        run_step(s, out)
        check(s)
    assert steps == [
        ([("a", 4), ("b", 4)], []),
        ([("a", 4), ("b", 4)], []),
        ([("a", 4), ("b", 4)], []),
        ([("a", 4), ("b", 4)], []),  # the pool is full: 4 + 4 blocks
        ([("a", 4)], ["b"]),  # a's last chunk takes b's blocks; b is not admitted again at once
        ([("a", 1), ("b", 7)], []),  # b starts over with the budget a's decode leaves
    ]
    assert b.num_preemptions == 1 and not s.waiting
