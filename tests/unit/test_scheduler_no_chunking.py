"""`enable_chunked_prefill=False`: a prompt is prefilled whole or not at all (vLLM's switch)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tandem.engine.block_manager import BlockManager
from tandem.engine.scheduler import Scheduler
from tests.unit.test_scheduler import check, req, run_step


def make(budget: int, num_blocks: int = 32) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 4, enable_prefix_caching=True),
        root_hash=123,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        enable_chunked_prefill=False,
    )


def scheduled(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    run_step(s, out)
    return [(r.request_id, n) for r, n in out.scheduled]


def test_a_prompt_that_does_not_fit_the_budget_left_waits_whole() -> None:
    s = make(budget=16)
    s.add(req("a", 10))
    s.add(req("b", 10, start=100))
    assert scheduled(s) == [("a", 10)]  # b is not chunked into the 6 tokens left
    assert scheduled(s) == [("a", 1), ("b", 10)]
    check(s)


def test_the_queue_waits_behind_its_head() -> None:
    s = make(budget=16)
    s.add(req("a", 12))
    s.add(req("b", 8, start=100))
    s.add(req("c", 2, start=200))
    assert scheduled(s) == [("a", 12)]  # c would fit, but b is first in line
    assert scheduled(s) == [("a", 1), ("b", 8), ("c", 2)]


def test_a_prompt_longer_than_the_budget_runs_whole_as_the_only_prompt_of_its_step() -> None:
    s = make(budget=8)
    s.add(req("a", 3))
    s.add(req("long", 20, start=100))
    assert scheduled(s) == [("a", 3)]  # "long" never runs beside another prompt
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("long", 20)]
    assert out.num_batched_tokens == 21  # over the budget: the price of no chunking
    run_step(s, out)
    assert scheduled(s) == [("a", 1), ("long", 1)]
    check(s)


def test_chunked_prefill_is_the_default() -> None:
    s = Scheduler(BlockManager(32, 4), 123, max_num_batched_tokens=8, max_num_seqs=8)
    s.add(req("long", 20))
    assert scheduled(s) == [("long", 8)]


def test_the_engine_setting_reaches_the_scheduler_and_tokens_do_not_change(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    from tandem import LLM, SamplingParams

    model = str(tiny_checkpoint())
    prompts = [list(range(3, 43)), list(range(50, 60))]  # 40 tokens: over the 16-token budget
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for chunked in (True, False):
        llm = LLM(
            model, max_num_batched_tokens=16, num_kv_blocks=64, enable_chunked_prefill=chunked
        )
        assert llm.engine.scheduler.enable_chunked_prefill is chunked
        outs[chunked] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
