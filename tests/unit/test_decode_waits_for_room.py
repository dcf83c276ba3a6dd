"""A decode worker with no KV room for a prompt now makes its reservation wait its turn (as a
request waits in vLLM's queue) instead of refusing it: granted once running requests give
blocks back, in arrival order; refused after `reserve_wait_s`, at once for a request with a
deadline (`wait_for_room=False`) or one that could never fit; forgotten when its stream closes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tandem import LLM
from tandem.decode_workers.decode_service import DecodeService
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_drain import DRAINING
from tandem.kv_transfer.receiver import ReservationGrant
from tandem.prefill_workers.prefill_service import PrefillService
from tests import pd_pair as pd_pair_module
from tests.pd_pair import pd_pair, wait_idle

model = pd_pair_module.model
reference = pd_pair_module.reference

BLOCKS = 12  # 192 tokens of KV on each side
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture()
def small(model: str) -> Iterator[tuple[PrefillService, DecodeService]]:
    with pd_pair(model, num_kv_blocks=BLOCKS) as pair:
        yield pair


def ids(seed: int, n: int) -> list[int]:
    return [20 + (seed * 31 + 7 * i) % 400 for i in range(n)]


async def grant_of(stream: AsyncIterator[dict[str, Any]]) -> ReservationGrant:
    item = await anext(stream)
    assert item["type"] == "grant", item
    return ReservationGrant(**item["grant"])


async def finish(
    prefill: PrefillService, rid: str, prompt: list[int], stream: AsyncIterator[dict[str, Any]]
) -> list[int]:
    """Runs the request's prefill with its grant and returns decode's tokens."""
    task = asyncio.create_task(prefill.prefill(rid, prompt, PARAMS, await grant_of(stream)))
    tokens = [t async for item in stream for t in item["token_ids"]]
    assert (await task)["status"] == "sent"
    return tokens


def test_a_reservation_without_room_waits_and_is_granted_when_blocks_come_back(
    small: Any, reference: LLM
) -> None:
    prefill, decode = small
    big, later, small_one = ids(1, 150), ids(2, 60), ids(3, 10)  # 10, 4 and 1 blocks

    async def main() -> tuple[list[int], list[int], list[int]]:
        first = decode.generate("big", big, PARAMS)
        grant = await grant_of(first)  # 10 of 12 blocks reserved
        waiting = decode.generate("later", later, PARAMS)
        assert await anext(waiting) == {"type": "queued"}
        # one that would fit (1 block) waits behind it: arrival order
        behind = decode.generate("small", small_one, PARAMS)
        assert await anext(behind) == {"type": "queued"}
        stats = await decode.get_stats()
        assert stats["num_waiting_reservations"] == stats["num_requests_waiting"] == 2
        assert stats["num_free_blocks"] == BLOCKS - 10
        task = asyncio.create_task(prefill.prefill("big", big, PARAMS, grant))
        tokens_big = [t async for item in first for t in item["token_ids"]]
        assert (await task)["status"] == "sent"
        tokens_later = await finish(prefill, "later", later, waiting)
        tokens_small = await finish(prefill, "small", small_one, behind)
        await wait_idle(prefill, decode)
        stats = await decode.get_stats()
        assert stats["num_waiting_reservations"] == 0
        # each prompt's full blocks looked up once, when reserved, however often it was tried
        assert stats["prefix_cache_queried_blocks"] == 150 // 16 + 60 // 16 + 10 // 16
        return tokens_big, tokens_later, tokens_small

    got = asyncio.run(main())
    expected = reference.generate([big, later, small_one], PARAMS)
    assert list(got) == [e.token_ids for e in expected]
    decode.post(decode.check_integrity)


def test_without_waiting_or_past_the_wait_or_never_fitting_it_is_refused(small: Any) -> None:
    _, decode = small

    async def main() -> None:
        first = decode.generate("big", ids(1, 150), PARAMS)
        await grant_of(first)
        # a request with a deadline does not wait: refused at once (429 at the router)
        at_once = [i async for i in decode.generate("x", ids(2, 60), PARAMS, wait_for_room=False)]
        assert [i["code"] for i in at_once] == ["no_capacity"]
        # a prompt larger than the whole pool never waits
        huge = [i async for i in decode.generate("huge", ids(3, 16 * BLOCKS + 1), PARAMS)]
        assert [i["code"] for i in huge] == ["no_capacity"]
        decode.waiting.wait_s = 0.2
        items = [i async for i in decode.generate("late", ids(4, 60), PARAMS)]
        assert items[0] == {"type": "queued"}
        assert [i["code"] for i in items[1:]] == ["no_capacity"]
        assert "within 0.2 s" in items[1]["error"]
        await first.aclose()
        await decode.release_unwritten("big")  # (the router's word: no prefill had its grant)
        _, d = await wait_idle(*small)
        assert d["num_waiting_reservations"] == 0

    asyncio.run(main())
    decode.post(decode.check_integrity)


def test_a_waiting_reservation_is_forgotten_when_its_stream_closes_and_refused_on_drain(
    small: Any, reference: LLM
) -> None:
    prefill, decode = small
    big, later = ids(1, 150), ids(2, 60)

    async def main() -> list[int]:
        first = decode.generate("big", big, PARAMS)
        grant = await grant_of(first)
        gone = decode.generate("gone", later, PARAMS)
        assert await anext(gone) == {"type": "queued"}
        await gone.aclose()  # the client left while it waited
        draining = decode.generate("moved", later, PARAMS)
        assert await anext(draining) == {"type": "queued"}
        decode.post(decode.refuse_waiting)  # the worker drains: it goes elsewhere
        item = await asyncio.wait_for(anext(draining), 5)
        assert item["type"] == "error" and item["code"] == DRAINING
        assert (await decode.get_stats())["num_waiting_reservations"] == 0
        task = asyncio.create_task(prefill.prefill("big", big, PARAMS, grant))
        tokens = [t async for item in first for t in item["token_ids"]]
        assert (await task)["status"] == "sent"
        await wait_idle(prefill, decode)  # nothing was reserved for the ones that left
        return tokens

    assert asyncio.run(main()) == reference.generate([big], PARAMS)[0].token_ids
    decode.post(decode.check_integrity)
