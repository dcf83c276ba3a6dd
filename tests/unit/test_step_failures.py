"""A failed engine step fails the requests of its batch, not the worker: blocks come back, the
next request is exact, and only steps that keep failing end the worker's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tandem import LLM
from tandem.decode_workers.decode_service import DecodeService
from tandem.engine import worker_loop
from tandem.engine.errors import StepFailedError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.receiver import ReservationGrant
from tandem.prefill_workers.prefill_service import PrefillService
from tandem.router.worker_failures import worker_error
from tests.pd_pair import pd_pair, run_pd, wait_idle

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def poison(engine: LLMEngine, bad_ids: set[str]) -> list[int]:
    """Makes every step whose batch holds a request in `bad_ids` raise (as a sampler or grammar
    bug would, after the forward pass); returns a list that counts the failures."""
    failures: list[int] = []
    process = engine.output_processor.process

    def failing(requests: list[Any], tokens: list[int]) -> Any:
        if any(r.request_id in bad_ids for r in requests):
            failures.append(len(requests))
            raise ValueError("injected failure")
        return process(requests, tokens)

    engine.output_processor.process = failing  # type: ignore[method-assign]
    return failures


async def on_loop(service: Any, fn: Any) -> Any:
    """`fn()` on the service's loop thread (its exception raised here)."""
    return await service.submit(fn)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint())


@pytest.fixture(scope="module")
def expected(model: str) -> list[int]:
    llm = LLM(model=model, num_kv_blocks=64)
    return llm.generate([list(range(20, 60))], PARAMS)[0].token_ids


def test_the_step_error_names_its_batch_and_generate_leaves_nothing_behind(
    model: str, expected: list[int]
) -> None:
    llm = LLM(model=model, num_kv_blocks=64)
    bm = llm.engine.block_manager
    failures = poison(llm.engine, {"req-0"})
    with pytest.raises(StepFailedError) as info:
        llm.generate([list(range(20, 60)), list(range(30, 50))], PARAMS)
    assert info.value.request_ids == ("req-0", "req-1")
    assert isinstance(info.value.cause, ValueError)
    assert "injected failure" in str(info.value)
    assert failures == [2]
    assert llm.engine.requests == {}
    llm.engine.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert llm.generate([list(range(20, 60))], PARAMS)[0].token_ids == expected


@pytest.fixture()
def pair(model: str) -> Iterator[tuple[PrefillService, DecodeService]]:
    with pd_pair(model, num_kv_blocks=64, prefill_batch_tokens=16) as services:
        yield services


async def local_tokens(decode: DecodeService, rid: str, prompt: list[int]) -> list[dict[str, Any]]:
    return [item async for item in decode.generate(rid, prompt, PARAMS, local_prefill=True)]


def test_a_decode_step_failure_fails_its_requests_and_decode_serves_on(
    pair: Any, expected: list[int]
) -> None:
    prefill, decode = pair
    failures = poison(decode.engine, {"bad"})

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        bad = await local_tokens(decode, "bad", list(range(20, 60)))
        good = await local_tokens(decode, "good", list(range(20, 60)))
        return bad, good

    bad, good = asyncio.run(main())
    assert failures == [1]
    assert bad == [
        {
            "type": "error",
            "code": "internal_error",
            "error": "decode worker: engine step failed: ValueError: injected failure",
        }
    ]
    assert [t for item in good for t in item["token_ids"]] == expected
    assert decode.alive and decode.num_step_failures == 1
    asyncio.run(wait_idle(prefill, decode))
    asyncio.run(on_loop(decode, decode.check_integrity))


def test_a_prefill_step_failure_fails_the_transfer_and_both_sides_let_go(
    pair: Any, expected: list[int]
) -> None:
    prefill, decode = pair
    failures = poison(prefill.engine, {"bad"})
    prompt = list(range(20, 60))  # prefill steps of 16 tokens: fails in the last, mid-stream

    async def main() -> tuple[Any, Any]:
        stream = decode.generate("bad", prompt, PARAMS)
        first = await anext(stream)
        assert first["type"] == "grant"
        outcome = await prefill.prefill("bad", prompt, PARAMS, ReservationGrant(**first["grant"]))
        rest = [item async for item in stream]
        return outcome, rest

    outcome, rest = asyncio.run(main())
    assert failures == [1]
    assert outcome["status"] == "failed"
    assert outcome["error"] == "prefill worker: engine step failed: ValueError: injected failure"
    assert [item["type"] for item in rest] == ["error"]
    assert rest[0]["code"] == "cancelled"
    assert prefill.alive and prefill.num_step_failures == 1
    asyncio.run(wait_idle(prefill, decode))
    tokens, _, last, good = asyncio.run(run_pd(prefill, decode, "good", prompt, PARAMS))
    assert tokens == expected and good["status"] == "sent" and last["finish_reason"] == "length"
    asyncio.run(wait_idle(prefill, decode))
    asyncio.run(on_loop(prefill, prefill.engine.check_integrity))


def test_steps_that_keep_failing_end_the_worker(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, decode = pair
    monkeypatch.setattr(worker_loop, "MAX_STEP_FAILURES", 3)
    poison(decode.engine, {"a", "b", "c"})

    async def main() -> list[list[dict[str, Any]]]:
        return [await local_tokens(decode, rid, list(range(20, 40))) for rid in "abc"]

    a, b, c = asyncio.run(main())
    assert a[0]["code"] == b[0]["code"] == "internal_error"
    assert c[0]["code"] == "worker_died"
    assert "3 engine steps failed within 60 s" in c[0]["error"]
    assert not decode.alive


def test_the_router_answers_a_failed_step_with_a_500_and_a_json_error() -> None:
    message = "decode worker: engine step failed: ValueError: injected failure"
    err = worker_error({"type": "error", "code": "internal_error", "error": message})
    assert err.status == 500
    assert err.body() == {
        "error": {
            "message": message,
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert worker_error({"type": "error", "code": "worker_died", "error": "x"}).status == 503


def test_a_transferred_request_fails_on_decode_and_both_sides_let_go(
    pair: Any, expected: list[int]
) -> None:
    prefill, decode = pair
    failures = poison(decode.engine, {"bad"})
    prompt = list(range(20, 60))

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        stream = decode.generate("bad", prompt, PARAMS)
        first = await anext(stream)
        grant = ReservationGrant(**first["grant"])
        outcome = await prefill.prefill("bad", prompt, PARAMS, grant)
        return [item async for item in stream], outcome

    items, outcome = asyncio.run(main())
    assert failures == [1] and outcome["status"] == "sent"
    assert [i["type"] for i in items][-1] == "error" and items[-1]["code"] == "internal_error"
    assert decode.alive and decode.num_step_failures == 1
    asyncio.run(wait_idle(prefill, decode))
    asyncio.run(on_loop(decode, decode.check_integrity))
    tokens, _, _, good = asyncio.run(run_pd(prefill, decode, "good", prompt, PARAMS))
    assert tokens == expected and good["status"] == "sent"
