"""A prefill started before decode's reservation, and a grant that comes early, late or never:
the pages wait for the grant, and whatever ends first releases both sides at once."""

from __future__ import annotations

import asyncio
import functools
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tandem import LLM
from tandem.engine.errors import InvalidRequestError
from tandem.engine.recent_mean import RecentMean
from tandem.engine.rpc import RPCClient, RPCServer
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.receiver import ReservationGrant
from tests import pd_pair as pd_pair_module
from tests.pd_pair import PROMPTS, run_pd, wait_idle

model = pd_pair_module.model  # the shared fixtures
reference = pd_pair_module.reference
services = pd_pair_module.services


def test_prefill_runs_before_the_reservation_arrives(services: Any, reference: LLM) -> None:
    """Prefill computes while decode reserves: the pages wait (kept) for `attach_grant`."""
    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = reference.generate([ids], params)[0]

    async def main() -> tuple[list[int], dict[str, Any], dict[str, Any]]:
        early: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(prefill.prefill("later", ids, params, None, first_token=early))
        first = await asyncio.wait_for(early, 10)  # prefill done, nothing reserved yet
        assert (await prefill.get_stats())["num_transfers"] == 1
        stream = decode.generate("later", ids, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        await prefill.attach_grant("later", grant)
        tokens = [t async for item in stream for t in item["token_ids"]]
        return tokens, first, await task

    tokens, first, outcome = asyncio.run(main())
    assert tokens == expected.token_ids
    assert first["token_ids"] == expected.token_ids[:1]
    assert outcome["status"] == "sent"
    asyncio.run(wait_idle(prefill, decode))


def test_a_reservation_that_comes_before_its_prefill_call_waits_for_it(
    services: Any, reference: LLM
) -> None:
    """The router's prefill call and its grant can cross on their way to a worker (the grant
    leaving on a connection another call just opened): the grant is kept for the prefill."""
    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = reference.generate([ids], params)[0]

    async def main() -> tuple[list[int], dict[str, Any]]:
        stream = decode.generate("crossed", ids, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        await prefill.attach_grant("crossed", grant)  # before the prefill call
        outcome = await asyncio.wait_for(prefill.prefill("crossed", ids, params, None), 10)
        tokens = [t async for item in stream for t in item["token_ids"]]
        return tokens, outcome

    tokens, outcome = asyncio.run(main())
    assert tokens == expected.token_ids and outcome["status"] == "sent"
    asyncio.run(wait_idle(prefill, decode))


def test_cancel_or_bad_grant_before_the_reservation_releases_prefill(
    services: Any, reference: LLM
) -> None:
    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[3])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main() -> dict[str, Any]:
        task = asyncio.create_task(prefill.prefill("c", ids, params, None))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(prefill, decode)
        task = asyncio.create_task(prefill.prefill("g", ids, params, None))
        await asyncio.sleep(0.05)
        bad = ReservationGrant("g", decode.address, [1], 0, 30.0)
        with pytest.raises(ValueError, match="reservation has 1 blocks"):
            await prefill.attach_grant("g", bad)
        await prefill.attach_grant("unknown", bad)  # (kept for a prefill call still to come)
        return await asyncio.wait_for(task, 10)

    outcome = asyncio.run(main())
    assert outcome["status"] == "failed" and "reservation has 1 blocks" in outcome["error"]
    p, _ = asyncio.run(wait_idle(prefill, decode))
    assert p["num_transfers"] == 0


@pytest.mark.parametrize("close_first", [True, False])
def test_a_reservation_never_granted_to_prefill_is_released_at_once(
    services: Any, reference: LLM, close_first: bool
) -> None:
    """The router closes a request whose grant it never handed to a prefill worker, and says
    so: decode's reservation is released at once, whichever of the two reaches it first
    (without the word it would be held for the stall timeout, 10 s)."""
    prefill, decode = services
    prompt = reference.tokenizer.encode(PROMPTS[1] * 2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main() -> None:
        stream = decode.generate("left", prompt, params)
        first = await anext(stream)
        assert first["type"] == "grant"
        blocks = len(first["grant"]["dst_block_ids"])
        if close_first:
            await stream.aclose()
            assert await decode.release_unwritten("left") == blocks
        else:
            assert await decode.release_unwritten("left") == blocks
            await stream.aclose()
        stats = await decode.get_stats()
        assert stats["num_held_reservations"] == stats["num_reservations"] == 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
        await wait_idle(prefill, decode)

    asyncio.run(main())
    tokens, *_ = asyncio.run(run_pd(prefill, decode, "after", prompt, params))
    assert tokens == reference.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("decode_closed_first", [True, False])
def test_a_grant_that_comes_after_prefill_ended_is_released_on_decode_at_once(
    services: Any, reference: LLM, decode_closed_first: bool
) -> None:
    """The client leaves while prefill runs without its reservation: the prefill ends before
    the router's `grant` call reaches it. The prefill worker refuses that grant and tells the
    decode worker, whose reserved blocks come back now, not after its stall timeout (10 s)."""
    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main() -> None:
        task = asyncio.create_task(prefill.prefill("late", ids, params, None))
        await asyncio.sleep(0.05)
        task.cancel()  # the client left: the router closes the prefill call
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = decode.generate("late", ids, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        if decode_closed_first:
            await stream.aclose()  # decode cancels its reservation: held, no sender known
        with pytest.raises(KeyError, match="ended"):
            await prefill.attach_grant("late", grant)  # the router's grant call, late
        if not decode_closed_first:
            item = await asyncio.wait_for(anext(stream), 5)
            assert item["type"] == "error" and item["code"] == "cancelled"
        p, d = await wait_idle(prefill, decode)  # (2 s at most here, not the 10 s hold)
        assert d["num_held_reservations"] == 0

    asyncio.run(main())
    decode.post(decode.check_integrity)
    tokens, *_ = asyncio.run(run_pd(prefill, decode, "after", ids, params))
    assert tokens == reference.generate([ids], params)[0].token_ids


def test_a_grant_whose_prefill_never_comes_is_released_when_it_expires(
    services: Any, reference: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grant kept for a prefill call that never came (`EARLY_GRANT_S`) is dropped with a
    word to its decode worker, which frees the blocks then."""
    from tandem.prefill_workers import prefill_service

    monkeypatch.setattr(prefill_service, "EARLY_GRANT_S", 0.0)
    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[3])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = reference.generate([ids], params)[0].token_ids

    async def main() -> list[int]:
        orphan = decode.generate("orphan", ids, params)
        await prefill.attach_grant("orphan", ReservationGrant(**(await anext(orphan))["grant"]))
        await orphan.aclose()  # the router gave up before its prefill call went out
        assert (await decode.get_stats())["num_held_reservations"] == 1
        stream = decode.generate("next", ids, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        await prefill.attach_grant("next", grant)  # comes early too; the orphan's expired
        task = asyncio.create_task(prefill.prefill("next", ids, params, None))
        tokens = [t async for item in stream for t in item["token_ids"]]
        assert (await task)["status"] == "sent"
        _, d = await wait_idle(prefill, decode)
        assert d["num_held_reservations"] == 0
        return tokens

    assert asyncio.run(main()) == expected


def test_a_prefill_started_again_with_its_grant_is_not_ended_by_the_first_ones_cancel(
    services: Any, reference: LLM
) -> None:
    """The router stops a prefill it started before decode's reservation when decode says the
    reservation waits for room, and starts it again, same request id, with the grant: the
    first call's end ("cancelled before reservation") must not end the second."""
    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main() -> tuple[list[int], dict[str, Any]]:
        stream = decode.generate("again", ids, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        early = asyncio.create_task(prefill.prefill("again", ids, params, None))
        await asyncio.sleep(0.02)
        # (the loop thread busy meanwhile: the cancel and the new start run back to back)
        prefill.post(lambda: time.sleep(0.3))
        early.cancel()
        with pytest.raises(asyncio.CancelledError):
            await early
        task = asyncio.create_task(prefill.prefill("again", ids, params, grant))
        tokens = [t async for item in stream for t in item["token_ids"]]
        return tokens, await task

    tokens, outcome = asyncio.run(main())
    assert outcome["status"] == "sent", outcome
    assert tokens == reference.generate([ids], params)[0].token_ids
    asyncio.run(wait_idle(prefill, decode))


def test_a_prefill_call_cancelled_over_rpc_ends_before_its_next_call_starts(
    services: Any, reference: LLM
) -> None:
    """Over the workers' RPC, the router's cancel of the first call and its new call (same
    request id, with the grant) reach the prefill worker in one read: the cancel must reach its
    engine first. (It came second: the new call failed, "request id ... is already in use",
    and decode held the reservation for its stall timeout.)"""
    from tandem.prefill_workers.deployment import PrefillWorker

    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[1])
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    worker = SimpleNamespace(service=prefill, ttft_ms=RecentMean(5.0))
    handler = functools.partial(PrefillWorker.func_or_class._rpc_prefill, worker)

    async def main() -> tuple[list[int], list[dict[str, Any]]]:
        server = RPCServer({"prefill": handler}, "token")
        client = RPCClient(await server.start(), "token")
        stream = decode.generate("again", ids, SamplingParams(**params))
        grant = (await anext(stream))["grant"]

        async def call(**extra: Any) -> list[dict[str, Any]]:
            items = client.stream("prefill", request_id="again", prompt_token_ids=ids,
                                  params=params, stream_first_token=True, **extra)  # fmt: skip
            return [item async for item in items]

        prefill.post(lambda: time.sleep(0.5))  # (the loop thread busy: the commands queue)
        first = asyncio.create_task(call())
        await asyncio.sleep(0.1)  # (the call is under way; its first token is not out yet)
        first.cancel()  # writes the call's cancel frame, then the next call's frame: one read
        again = asyncio.create_task(call(grant=grant))
        with pytest.raises(asyncio.CancelledError):
            await first
        items = await again
        tokens = [t async for item in stream for t in item["token_ids"]]
        await client.close()
        await server.close()
        return tokens, items

    tokens, items = asyncio.run(main())
    assert items[-1]["status"] == "sent", items
    assert tokens == reference.generate([ids], SamplingParams(**params))[0].token_ids
    _, d = asyncio.run(wait_idle(prefill, decode))
    assert d["num_held_reservations"] == 0


def test_a_call_with_a_grant_that_cannot_start_releases_the_reservation_at_once(
    services: Any, reference: LLM
) -> None:
    """A prefill call that brings decode's grant and fails to start (here: its request id is
    taken) tells decode at once that no page will come: the reservation is freed now."""
    prefill, decode = services
    ids = reference.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main() -> dict[str, Any]:
        blocker = asyncio.create_task(prefill.prefill("taken", ids, params, None))
        await asyncio.sleep(0.1)
        stream = decode.generate("taken", ids, params)
        grant = ReservationGrant(**(await anext(stream))["grant"])
        with pytest.raises(InvalidRequestError, match="already in use"):
            await prefill.prefill("taken", ids, params, grant)
        last = [item async for item in stream][-1]
        blocker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocker
        return last

    start = time.monotonic()
    last = asyncio.run(main())
    assert last["type"] == "error", last
    assert time.monotonic() - start < 2.0  # not decode's stall timeout
    _, d = asyncio.run(wait_idle(prefill, decode))
    assert d["num_held_reservations"] == 0
