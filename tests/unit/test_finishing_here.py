"""A one-token request ends on the prefill worker (`finish_here`): the same token, text, finish
and logprobs as through decode, with nothing reserved on decode and no page sent."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem import LLM
from tandem.engine.output_text import OutputText
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.receiver import ReservationGrant
from tests import pd_pair as pd_pair_module
from tests.pd_pair import run_pd, wait_idle

model = pd_pair_module.model  # the shared fixtures
reference = pd_pair_module.reference
services = pd_pair_module.services


def _prompt(reference: LLM, i: int) -> list[int]:
    return reference.tokenizer.encode(f"request {i}: the quick brown fox jumps " * (i + 1))


def _stop_at_first_token(reference: LLM) -> tuple[list[int], SamplingParams]:
    """A prompt whose first token shows text, and a stop string that is that text."""
    for start in range(40):
        prompt = [(start * 13 + 7 * j) % 400 + 20 for j in range(40)]
        first = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        shown = OutputText.after(reference.tokenizer, prompt, first.token_ids).text
        if shown.strip():
            return prompt, SamplingParams(temperature=0, max_tokens=1, stop=[shown])
    raise AssertionError("no prompt's first token shows text")


CASES: list[tuple[str, Any]] = [
    ("greedy", SamplingParams(temperature=0, max_tokens=1)),
    ("logprobs", SamplingParams(temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=1)),
    ("seeded", SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=1)),
    ("stop", None),  # a stop string that is the first token's text
]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[c[0] for c in CASES])
def test_a_one_token_request_ends_on_prefill_as_it_would_through_decode(
    services: Any, reference: LLM, name: str, params: SamplingParams | None
) -> None:
    prefill, decode = services
    prompt = _prompt(reference, 2)
    if params is None:
        prompt, params = _stop_at_first_token(reference)
    tokens, text, last, _ = asyncio.run(run_pd(prefill, decode, f"pd-{name}", prompt, params))

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        await wait_idle(prefill, decode)
        before_p, before_d = await prefill.get_stats(), await decode.get_stats()
        outcome = await prefill.prefill(f"here-{name}", prompt, params, None, finish_here=True)
        after_p, after_d = await prefill.get_stats(), await decode.get_stats()
        assert after_p["kv_transfer_bytes"] == before_p["kv_transfer_bytes"]  # nothing sent
        assert after_d == before_d  # decode saw nothing
        await wait_idle(prefill, decode)
        return outcome, before_p, after_p

    outcome, *_ = asyncio.run(main())
    item = outcome["item"]
    assert outcome["status"] == "finished" and outcome["first_token_ids"] == tokens
    expected = reference.generate([prompt], params)[0]
    assert item["token_ids"] == tokens == expected.token_ids
    assert item["text"] == text == expected.text
    assert item["finish_reason"] == last["finish_reason"] == expected.finish_reason
    assert item["stop_reason"] == last["stop_reason"]
    assert item["num_transferred_blocks"] == 0
    if name == "logprobs":
        assert item["logprobs"] == last["logprobs"]
        assert len(item["prompt_logprobs"]) == len(prompt)
    if name == "stop":
        assert item["finish_reason"] == "stop" and item["text"] == ""


def test_the_prefill_cache_serves_a_repeated_one_token_request(
    services: Any, reference: LLM
) -> None:
    prefill, decode = services
    prompt = _prompt(reference, 5)
    params = SamplingParams(temperature=0, max_tokens=1)

    async def main() -> list[dict[str, Any]]:
        return [
            (await prefill.prefill(f"again{i}", prompt, params, None, finish_here=True))["item"]
            for i in range(2)
        ]

    first, second = asyncio.run(main())
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == len(prompt) // 16 * 16  # its full blocks
    assert second["token_ids"] == first["token_ids"]
    asyncio.run(wait_idle(prefill, decode))


def test_cancelling_a_one_token_request_mid_prefill_frees_its_blocks(
    services: Any, reference: LLM
) -> None:
    prefill, decode = services
    prompt = _prompt(reference, 12)  # ~30 steps of 32 tokens
    params = SamplingParams(temperature=0, max_tokens=1)

    async def main() -> None:
        before = (await prefill.get_stats())["num_cancelled"]
        task = asyncio.create_task(prefill.prefill("gone", prompt, params, None, finish_here=True))
        for _ in range(200):
            if (await prefill.get_stats())["num_requests"]:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(prefill, decode)
        assert (await prefill.get_stats())["num_cancelled"] == before + 1

    asyncio.run(main())
    tokens, *_ = asyncio.run(run_pd(prefill, decode, "after", prompt, params))
    assert tokens == reference.generate([prompt], params)[0].token_ids


def test_a_request_that_ends_here_takes_no_reservation(services: Any) -> None:
    prefill, _ = services
    grant = ReservationGrant("g", "local:x", [1], 0, 30.0)

    async def main() -> None:
        with pytest.raises(ValueError, match="takes no reservation"):
            prefill.begin("g", [1, 2, 3], SamplingParams(max_tokens=1), grant, finish_here=True)

    asyncio.run(main())
