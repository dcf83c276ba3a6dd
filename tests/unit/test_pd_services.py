"""Prefill and decode services (no Ray) joined by the local transport: exact, cancellable."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tandem import LLM
from tandem.engine.output_text import OutputText
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.receiver import ReservationGrant
from tests import pd_pair as pd_pair_module
from tests.pd_pair import PROMPTS, run_pd, wait_idle

model = pd_pair_module.model  # the shared fixtures
reference = pd_pair_module.reference
services = pd_pair_module.services


def test_pd_services_match_colocated_llm(services: Any, reference: LLM) -> None:
    prefill, decode = services
    tok = reference.tokenizer
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [tok.encode(p) for p in PROMPTS]
    expected = reference.generate(prompts, params)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(run_pd(prefill, decode, f"r{i}", p, params) for i, p in enumerate(prompts))
        )

    results = asyncio.run(main())
    for (tokens, text, last, outcome), exp in zip(results, expected, strict=True):
        assert tokens == exp.token_ids
        assert text == exp.text
        assert last["finish_reason"] == "length"
        assert outcome["status"] == "sent"
        assert outcome["first_token_ids"] == exp.token_ids[:1]
    asyncio.run(wait_idle(prefill, decode))
    decode.post(decode.check_integrity)


def test_first_token_can_end_the_request(services: Any, reference: LLM) -> None:
    prefill, decode = services
    prompt = reference.tokenizer.encode("one token only")
    params = SamplingParams(temperature=0, max_tokens=1)
    expected = reference.generate([prompt], params)[0]
    tokens, text, last, outcome = asyncio.run(run_pd(prefill, decode, "one", prompt, params))
    assert tokens == expected.token_ids
    assert text == expected.text
    assert last["finish_reason"] == expected.finish_reason == "length"
    assert outcome["status"] == "sent"


def test_a_prompt_one_token_short_of_the_context_gets_one_token_as_colocated(
    services: Any, reference: LLM
) -> None:
    prefill, decode = services
    room = min(prefill.engine.max_model_len, decode.engine.max_model_len)
    prompt = [(7 * i) % 400 + 20 for i in range(room - 1)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = reference.generate([prompt], params)[0]
    tokens, _, last, _ = asyncio.run(run_pd(prefill, decode, "full", prompt, params))
    assert tokens == expected.token_ids and len(tokens) == 1
    assert last["finish_reason"] == expected.finish_reason == "length"
    asyncio.run(wait_idle(prefill, decode))


@pytest.mark.parametrize(
    ("prompt", "params", "streamed"),
    [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), True),
        (PROMPTS[3], SamplingParams(temperature=0.8, seed=3, max_tokens=6), True),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop=["zz"]), False),
        (PROMPTS[1], SamplingParams(temperature=0, max_tokens=1), False),
    ],
)
def test_prefill_streams_the_first_token_as_decode_will(
    services: Any, reference: LLM, prompt: str, params: SamplingParams, streamed: bool
) -> None:
    """The early first token (for the router) is decode's first token and its text; not sent
    when decode may hold text back for a stop string, or when that token ends the request."""
    prefill, decode = services
    ids = reference.tokenizer.encode(prompt)
    expected = reference.generate([ids], params)[0]

    async def main() -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
        stream = decode.generate("first", ids, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        early: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(prefill.prefill("first", ids, params, grant, first_token=early))
        items = [item async for item in stream]
        return await early, items, await task

    early, items, outcome = asyncio.run(main())
    assert [t for item in items for t in item["token_ids"]] == expected.token_ids
    assert outcome["status"] == "sent"
    if not streamed:
        assert early is None
        return
    assert early["token_ids"] == outcome["first_token_ids"] == expected.token_ids[:1]
    assert items[0]["token_ids"][:1] == early["token_ids"]
    assert items[0]["text"].startswith(early["text"])
    assert expected.text.startswith(early["text"])


def test_stop_string_and_seeded_sampling_match(services: Any, reference: LLM) -> None:
    prefill, decode = services
    prompt = reference.tokenizer.encode(PROMPTS[1])
    for params in (
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ):
        expected = reference.generate([prompt], params)[0]
        stop = expected.text[len(expected.text) // 2 : len(expected.text) // 2 + 2]
        if stop.strip() and params.temperature == 0:
            params = params.model_copy(update={"stop": [stop]})
            expected = reference.generate([prompt], params)[0]
        tokens, text, last, _ = asyncio.run(
            run_pd(prefill, decode, f"s{params.seed}", prompt, params)
        )
        assert tokens == expected.token_ids
        assert text == expected.text
        assert last["finish_reason"] == expected.finish_reason


def test_stop_string_in_the_first_token_ends_the_request_as_colocated(
    services: Any, reference: LLM
) -> None:
    """The prefill engine runs without stop strings: the first token's text is checked
    against them before the last chunk goes, so decode computes nothing more."""
    prefill, decode = services
    checked = 0
    candidates = [[(start * 13 + 7 * j) % 400 + 20 for j in range(40)] for start in range(40)]
    for i, prompt in enumerate(candidates):
        if checked == 2:
            break
        first = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        # the text the first token shows while streaming (a detokenizer may hold some back)
        shown = OutputText.after(reference.tokenizer, prompt, first.token_ids).text
        if not shown.strip():
            continue
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[shown])
        expected = reference.generate([prompt], params)[0]
        assert expected.finish_reason == "stop" and expected.token_ids == first.token_ids
        tokens, got, last, outcome = asyncio.run(run_pd(prefill, decode, f"f{i}", prompt, params))
        assert tokens == expected.token_ids
        assert got == expected.text == ""
        assert last["finish_reason"] == "stop"
        assert last["stop_reason"] == shown
        assert outcome["status"] == "sent"
        checked += 1
    assert checked >= 2
    asyncio.run(wait_idle(prefill, decode))


def test_a_stop_string_in_the_first_token_does_not_count_within_min_tokens(
    services: Any, reference: LLM
) -> None:
    """With min_tokens=1 the first token's text is not searched (nor later, as part of the
    text before the stop strings count): the request goes on as `LLM.generate`'s does."""
    prefill, decode = services
    for start in range(40):  # a prompt whose first token writes text
        prompt = [(start * 13 + 7 * j) % 400 + 20 for j in range(40)]
        first = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        shown = OutputText.after(reference.tokenizer, prompt, first.token_ids).text
        if shown.strip():
            break
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, stop=[shown.strip()[-1]], min_tokens=1
    )
    expected = reference.generate([prompt], params)[0]
    assert len(expected.token_ids) > 1
    tokens, text, last, _ = asyncio.run(run_pd(prefill, decode, "min1", prompt, params))
    assert tokens == expected.token_ids
    assert text == expected.text
    assert last["finish_reason"] == expected.finish_reason
    asyncio.run(wait_idle(prefill, decode))


def test_closing_the_stream_cancels_on_both_sides(services: Any, reference: LLM) -> None:
    prefill, decode = services
    prompt = reference.tokenizer.encode(PROMPTS[1] * 2)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        stream = decode.generate("gone", prompt, params)
        first = await anext(stream)
        grant = ReservationGrant(**first["grant"])
        task = asyncio.create_task(prefill.prefill("gone", prompt, params, grant))
        item = await anext(stream)
        assert item["type"] == "tokens"
        await stream.aclose()  # the client went away mid-stream
        outcome = await asyncio.wait_for(task, 10)
        assert outcome["status"] == "sent"
        await wait_idle(prefill, decode)

    asyncio.run(main())
    # the next request is exact: no page was left behind or reused
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens, *_ = asyncio.run(run_pd(prefill, decode, "next", prompt, params))
    assert tokens == reference.generate([prompt], params)[0].token_ids


def test_cancel_during_prefill_releases_both_sides(services: Any, reference: LLM) -> None:
    prefill, decode = services
    prompt = reference.tokenizer.encode(PROMPTS[1] * 4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main() -> None:
        stream = decode.generate("early", prompt, params)
        first = await anext(stream)
        task = asyncio.create_task(
            prefill.prefill("early", prompt, params, ReservationGrant(**first["grant"]))
        )
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        item = await asyncio.wait_for(anext(stream), 10)
        assert item["type"] == "error" and item["code"] == "cancelled"
        await wait_idle(prefill, decode)

    asyncio.run(main())


def test_local_prefill_on_decode_reuses_its_cache_without_transfer(
    services: Any, reference: LLM
) -> None:
    _, decode = services
    prompt = reference.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[])

    firsts: list[dict[str, Any]] = []

    async def run(rid: str, ids: list[int]) -> tuple[list[int], dict[str, Any]]:
        tokens: list[int] = []
        last: dict[str, Any] = {}
        async for item in decode.generate(rid, ids, params, local_prefill=True):
            assert item["type"] == "tokens", item
            if not tokens:
                firsts.append(item)
            tokens += item["token_ids"]
            last = item
        return tokens, last

    first, last = asyncio.run(run("turn1", prompt))
    assert first == reference.generate([prompt], params)[0].token_ids
    assert last["local_prefill"] and last["num_transferred_blocks"] == 0
    assert "transfer_wait_s" not in last["timings"] and "decode_s" in last["timings"]
    # (its prefill rate, for admission: the router assumed a default for decode workers)
    assert decode.stats()["prefill_tokens_per_s"] > 0
    follow_up = prompt + first + reference.tokenizer.encode(" and then")
    second, last = asyncio.run(run("turn2", follow_up))
    assert second == reference.generate([follow_up], params)[0].token_ids
    assert last["num_cached_tokens"] == (len(prompt) + len(first) - 1) // 16 * 16
    # the first item already says so (usage reported while streaming)
    assert [f["num_cached_tokens"] for f in firsts] == [0, last["num_cached_tokens"]]


def test_stop_reason_of_a_stop_token_reaches_the_stream(services: Any, reference: LLM) -> None:
    prefill, decode = services
    prompt = reference.tokenizer.encode(PROMPTS[0])
    free = reference.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    stop_id = free[0].token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id])
    tokens, _, last, _ = asyncio.run(run_pd(prefill, decode, "stopper", prompt, params))
    expected = reference.generate([prompt], params)[0]
    assert tokens == expected.token_ids
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", expected.stop_reason)


def test_a_stream_interval_sends_fewer_items_and_the_same_tokens(
    services: Any, reference: LLM
) -> None:
    """With `stream_interval` 3, every item between decode's first (the committed first token)
    and its last carries at least 3 tokens; tokens, text and usage counts are unchanged."""
    prefill, decode = services
    prompt = reference.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    expected = reference.generate([prompt], params)[0]

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        stream = decode.generate("gathered", prompt, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        task = asyncio.create_task(prefill.prefill("gathered", prompt, params, grant))
        items = [item async for item in stream]
        return items, await task

    async def local() -> list[dict[str, Any]]:
        local = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        return [item async for item in decode.generate("here", prompt, local, local_prefill=True)]

    decode.stream_interval = 3
    try:
        items, outcome = asyncio.run(main())
        here = asyncio.run(local())
    finally:
        decode.stream_interval = 1
    # A local prefill's first token is not held: items of 1, 3, 3, 3 tokens (the consumer
    # merges items that were queued together, so the first may be 4, 7 or 10 long).
    assert len(here[0]["token_ids"]) % 3 == 1
    assert [t for item in here for t in item["token_ids"]] == reference.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0].token_ids
    assert [t for item in items for t in item["token_ids"]] == expected.token_ids
    assert "".join(item["text"] for item in items) == expected.text
    assert all(len(item["token_ids"]) >= 3 for item in items[1:-1])
    assert len(items) <= 1 + -(-(len(expected.token_ids) - 1) // 3)
    assert items[-1]["finish_reason"] == "length"
    assert "num_cached_tokens" in items[-1] and outcome["status"] == "sent"
    asyncio.run(wait_idle(prefill, decode))


def test_prefill_timings_are_never_negative_when_a_request_is_slow_to_set_up(
    services: Any, reference: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set-up after the engine stamps a request's arrival (e.g. compiling a new grammar) counts
    in its queue stage, not against its prefill stage: every stage is >= 0."""
    prefill, decode = services
    real_add = prefill.engine.add_request

    def slow_add(*args: Any, **kwargs: Any) -> Any:
        req = real_add(*args, **kwargs)
        time.sleep(0.05)
        return req

    monkeypatch.setattr(prefill.engine, "add_request", slow_add)
    ids = reference.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens, _, _, outcome = asyncio.run(run_pd(prefill, decode, "slow-setup", ids, params))
    assert tokens == reference.generate([ids], params)[0].token_ids
    timings = outcome["timings"]
    assert timings["queue_s"] >= 0.05
    assert min(timings.values()) >= 0.0, timings
