"""Route planning without Ray: decode by held prefix, conditional local prefill, admission."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem.engine.hashing import hash_full_blocks, root_hash
from tandem.engine.rpc import RPCClient
from tandem.router.admission import AdmissionConfig
from tandem.router.errors import APIError
from tandem.router.plan_moves import reassign
from tandem.router.prefix_index import KVEventBatch
from tandem.router.route_planner import DecodeRoutingConfig, RoutePlanner
from tandem.router.routing_policy import RoutingConfig
from tandem.router.worker_directory import Worker, WorkerDirectory

NS = "namespace-digest"
ROOT = root_hash(NS)
INFO = {"block_size": 16, "namespace": NS, "root_hash": ROOT}


def directory(*workers: tuple[str, str, dict[str, Any]]) -> WorkerDirectory:
    d = WorkerDirectory(registry=None, auth_token="t")
    for wid, role, stats in workers:
        d.workers[wid] = Worker(wid, role, RPCClient("127.0.0.1:1", "t"), stats=stats)
    return d


def publish(d: WorkerDirectory, wid: str, tokens: list[int], seq: int = 0) -> None:
    hashes = hash_full_blocks(ROOT, tokens, 16)
    assert d.index.apply(KVEventBatch(worker_id=wid, seq=seq, namespace=NS, stored=hashes))


def planner(d: WorkerDirectory, **admission: Any) -> RoutePlanner:
    return RoutePlanner(
        d, RoutingConfig(), DecodeRoutingConfig(), AdmissionConfig.model_validate(admission)
    )


def plan(p: RoutePlanner, prompt: list[int], deadline_ms: float | None = None) -> Any:
    async def main() -> Any:
        return await p.plan(prompt, INFO, deadline_ms, hold_s=60, max_tokens=8)

    return asyncio.run(main())


WORKERS = (
    ("p0", "prefill", {}),
    ("p1", "prefill", {}),
    ("d0", "decode", {"kv_cache_usage": 0.1}),
    ("d1", "decode", {"kv_cache_usage": 0.0}),
)


def test_a_new_prompt_goes_to_the_least_loaded_decode_and_a_prefill_worker() -> None:
    d = directory(*WORKERS)
    route = plan(planner(d), list(range(100)))
    assert route.decode.worker_id == "d1" and route.decode_hit_blocks == 0
    assert route.prefill is not None and route.prefill_tokens == 100
    assert (route.prefill.queued_tokens, route.decode.queued_tokens) == (100, 108)
    route.release()
    route.release()  # idempotent
    assert (route.prefill.queued_tokens, route.prefill.in_flight) == (0, 0)
    assert (route.decode.queued_tokens, route.decode.in_flight) == (0, 0)


def test_a_conversation_returns_to_its_decode_worker_and_a_short_tail_stays_there() -> None:
    d = directory(*WORKERS)
    history = list(range(10, 210))  # 12 full blocks held by d0
    publish(d, "d0", history)
    long_turn = plan(planner(d), history + list(range(300, 460)))  # 160-token tail: PD
    assert long_turn.decode.worker_id == "d0" and long_turn.decode_hit_blocks == 12
    assert long_turn.prefill is not None
    short_turn = plan(planner(d), history + list(range(300, 320)))  # 20+8-token tail: local
    assert short_turn.decode.worker_id == "d0" and short_turn.local_prefill


def test_a_holder_busier_than_the_least_busy_decode_by_more_than_the_gap_gives_way() -> None:
    """Prompts sharing a prefix go to the decode worker holding it only while it runs at
    most `max_in_flight_gap` requests more than the least busy one: a replica added by
    autoscaling (holding nothing yet) gets its share instead of none."""
    d = directory(*WORKERS)
    history = list(range(10, 210))
    publish(d, "d0", history)
    p = planner(d)
    held = [plan(p, history + list(range(300 + 200 * i, 460 + 200 * i))) for i in range(5)]
    # d0 keeps the first five (0..4 in flight before each: the gap of 4), then d1 takes one
    assert [r.decode.worker_id for r in held] == ["d0"] * 5
    moved = plan(p, history + list(range(2000, 2160)))
    assert moved.decode.worker_id == "d1" and moved.decode_hit_blocks == 0
    assert moved.prefill is not None and moved.prefill_tokens == 360
    held[0].release()  # (d0 at 4 in flight, d1 at 1: within the gap again)
    assert plan(p, history + list(range(3000, 3160))).decode.worker_id == "d0"


def test_prefill_affinity_follows_the_index() -> None:
    d = directory(*WORKERS)
    prefix = list(range(20, 340))  # 20 blocks on p1
    publish(d, "p1", prefix)
    route = plan(planner(d), prefix + list(range(400, 560)))
    assert route.prefill is not None and route.prefill.worker_id == "p1"
    assert route.prefill_hit_blocks == 20 and route.prefill_tokens == 160


def test_admission_refuses_an_unmeetable_deadline_before_holding_anything() -> None:
    d = directory(*WORKERS)
    d.workers["p0"].queued_tokens = d.workers["p1"].queued_tokens = 100_000
    d.workers["p0"].stats = d.workers["p1"].stats = {"prefill_tokens_per_s": 10_000.0}
    with pytest.raises(APIError) as info:
        plan(planner(d), list(range(100)), deadline_ms=500)
    assert info.value.status == 429 and info.value.headers
    assert all(w.in_flight == 0 for w in d.workers.values())
    assert d.workers["d1"].queued_tokens == 0


def test_colocated_mode_prefills_every_request_on_its_decode_worker() -> None:
    d = directory(("d0", "decode", {"kv_cache_usage": 0.2}), ("d1", "decode", {}))
    p = RoutePlanner(d, RoutingConfig(), DecodeRoutingConfig(), AdmissionConfig(), colocated=True)
    history = list(range(10, 210))
    publish(d, "d0", history)
    first = plan(p, list(range(1000, 1600)))  # long and new: still no prefill worker
    assert first.decode.worker_id == "d1" and first.local_prefill
    assert (first.prefill_tokens, first.decode.queued_tokens) == (600, 608)
    turn = plan(p, history + list(range(300, 700)))  # a long tail stays with the holder too
    assert turn.decode.worker_id == "d0" and turn.local_prefill and turn.decode_hit_blocks == 12


def test_colocated_prefills_queue_on_their_decode_worker_for_admission() -> None:
    """The prefills a decode worker runs itself (every one in colocated mode) queue there: the
    queue cap and deadlines count them, as a prefill worker's queue (they were admitted as if
    none waited: 16 concurrent 1,800-token prompts all passed a 300 ms deadline)."""
    d = directory(("d0", "decode", {"prefill_tokens_per_s": 10_000}))
    admission = AdmissionConfig.model_validate({"max_queued_prefill_tokens": 3000})
    p = RoutePlanner(d, RoutingConfig(), DecodeRoutingConfig(), admission, colocated=True)
    held = [plan(p, list(range(i * 1000, i * 1000 + 700))) for i in range(4)]  # 2,800 queued
    d0 = d.workers["d0"]
    assert d0.queued_prefill_tokens == 2800
    with pytest.raises(APIError) as full:
        plan(p, list(range(9000, 9700)))
    assert (full.value.status, full.value.code) == (429, "queue_full")
    with pytest.raises(APIError) as late:  # (2,800 + 100 tokens at 10k/s: ~290 ms)
        plan(p, list(range(9000, 9100)), deadline_ms=100)
    assert late.value.code == "deadline_unmeetable"
    held[0].release_prefill()  # (its first token came: its prefill no longer queues)
    assert d0.queued_prefill_tokens == 2100
    held[0].release()
    assert d0.queued_prefill_tokens == 2100  # (once)
    plan(p, list(range(9000, 9700)))
    for route in held[1:]:
        route.release()
    assert d0.queued_prefill_tokens == 700
    d.workers["d1"] = d1 = Worker("d1", "decode", RPCClient("127.0.0.1:1", "t"))
    moved = plan(p, list(range(20_000, 20_100)))  # (d1, the idlest)
    reassign(moved, "decode", d0)  # (as from a draining worker: its prefill goes along)
    assert (d1.queued_prefill_tokens, d0.queued_prefill_tokens) == (0, 800)


@pytest.mark.parametrize("colocated", [False, True])
def test_a_prefill_on_decode_is_held_to_the_deadline_too(colocated: bool) -> None:
    """A short tail prefilled by the decode worker holding the conversation (or any request in
    colocated mode) is refused when even that prefill cannot meet the deadline: it was
    admitted whatever its deadline."""
    d = directory(*WORKERS)
    history = list(range(10, 210))
    publish(d, "d0", history)
    p = RoutePlanner(
        d, RoutingConfig(), DecodeRoutingConfig(), AdmissionConfig(), colocated=colocated
    )
    with pytest.raises(APIError) as info:
        plan(p, history + list(range(300, 320)), deadline_ms=0.001)
    assert info.value.status == 429 and info.value.code == "deadline_unmeetable"
    assert all(w.in_flight == 0 and w.queued_tokens == 0 for w in d.workers.values())
    turn = plan(p, history + list(range(300, 320)), deadline_ms=1000)
    assert turn.local_prefill and turn.decode.worker_id == "d0"


def test_a_worker_that_registers_again_starts_without_the_old_connection_s_load() -> None:
    """A decode worker back at a new address (a restarted replica keeping its id): the plans
    made before give their load back to the old record, so the new one starts at zero (it
    took the old counts, which no plan released: its queue stayed full and every request was
    refused `queue_full`)."""

    class Registry:
        def __init__(self, entry: dict[str, Any]) -> None:
            self.list = self
            self.entry = entry

        async def remote(self, *_: Any) -> list[dict[str, Any]]:
            return [self.entry]

    async def main() -> None:
        entry = {"worker_id": "d0", "role": "decode", "rpc_address": "127.0.0.1:9"}
        d = WorkerDirectory(registry=Registry(entry), auth_token="t")
        await d.refresh()
        admission = AdmissionConfig.model_validate({"max_queued_prefill_tokens": 3000})
        p = RoutePlanner(d, RoutingConfig(), DecodeRoutingConfig(), admission, colocated=True)
        held = [await p.plan(list(range(i * 1000, i * 1000 + 700)), INFO, None, 60, 8)
                for i in range(4)]  # fmt: skip
        d.registry = Registry({**entry, "rpc_address": "127.0.0.1:10"})
        await d.refresh()
        for route in held:  # (they failed with the old connection)
            route.release()
        new = d.workers["d0"]
        assert (new.in_flight, new.queued_tokens, new.queued_prefill_tokens) == (0, 0, 0)
        await p.plan(list(range(9000, 9300)), INFO, None, 60, 8)
        await d.close()

    asyncio.run(main())


@pytest.mark.parametrize("colocated", [False, True])
def test_a_requests_choices_are_admitted_as_one(colocated: bool) -> None:
    """n=3 of a prompt that alone fills the cap, on an idle cluster: every choice is admitted
    (choices 2 and 3 saw choice 1's tokens queued and got a 429, on every retry); with another
    request queued, the cap holds against the choices as against any request, and a choice's
    released plan (a worker lost: it plans again) no longer counts as the request's own."""
    from tandem.router.sibling_load import SiblingPlans

    d = directory(("p0", "prefill", {}), ("d0", "decode", {}))
    admission = AdmissionConfig.model_validate(
        {"max_queued_prefill_tokens": 3000, "max_decode_tokens": 3000}
    )
    p = RoutePlanner(d, RoutingConfig(), DecodeRoutingConfig(), admission, colocated=colocated)
    prompt = list(range(2500))

    async def choices(count: int, siblings: SiblingPlans) -> list[Any]:
        """Admitted all or none, as `multi_choice.prepare_all` admits them."""
        plans = [p.plan(prompt, INFO, None, 60, 8, siblings=siblings) for _ in range(count)]
        done = await asyncio.gather(*plans, return_exceptions=True)
        refused = [r for r in done if isinstance(r, BaseException)]
        if refused:
            for route in done:
                if not isinstance(route, BaseException):
                    route.release()
            raise refused[0]
        return done

    admitted = asyncio.run(choices(3, SiblingPlans()))
    assert len(admitted) == 3
    for route in admitted:
        route.release()
    other = plan(p, list(range(5000, 5100)))  # another request queued
    with pytest.raises(APIError) as full:
        asyncio.run(choices(3, SiblingPlans()))
    assert full.value.code in ("queue_full", "decode_queue_full")
    other.release()
    siblings = SiblingPlans()
    (lost,) = asyncio.run(choices(1, siblings))
    lost.release()  # (its worker was lost)
    plan(p, list(range(6000, 8500)))  # another request's, as large, queued meanwhile
    with pytest.raises(APIError):
        asyncio.run(choices(1, siblings))  # (was admitted: the released plan counted as own)


def test_with_no_live_prefill_worker_decode_prefills_the_request_itself() -> None:
    """The only prefill worker draining (a redeploy) or gone: requests were 503 (a router that
    stopped) or waited for its replacement's start-up (39 s on 2 cores)."""
    d = directory(*WORKERS)
    for wid in ("p0", "p1"):
        d.mark_draining(wid)
    p = planner(d)
    route = plan(p, list(range(100)))
    assert route.local_prefill and route.prefill is None and route.prefill_tokens == 100
    assert route.decode.worker_id == "d1"

    async def one_token() -> Any:
        return await p.plan(list(range(50)), INFO, None, hold_s=60, max_tokens=1)

    single = asyncio.run(one_token())  # (it ended on a prefill worker: decode computes it)
    assert single.local_prefill and single.decode is not None
    d.workers["p1"].draining = False
    assert plan(p, list(range(100, 200))).prefill.worker_id == "p1"


def test_a_request_whose_only_prefill_worker_drains_starts_over_for_decode() -> None:
    """Planned to the only prefill worker, which then drains (its call answered "draining"):
    the move waited for a replacement (27 s in a redeploy); it now starts over, and decode
    prefills it. With another prefill worker live, the request moves there."""
    from tandem.router.errors import WorkerLost
    from tandem.router.plan_moves import move_from_draining

    d = directory(("p0", "prefill", {}), ("p1", "prefill", {}), ("d0", "decode", {}))
    p = planner(d)
    route = plan(p, list(range(100)))
    route.grant_handed = True
    first = route.prefill.worker_id
    asyncio.run(move_from_draining(d, route, "prefill"))
    assert route.prefill.worker_id != first and route.grant_handed
    with pytest.raises(WorkerLost) as lost:
        asyncio.run(move_from_draining(d, route, "prefill"))
    assert lost.value.drained and lost.value.code == "prefill_failed"
    assert not route.grant_handed  # (nothing started there: decode frees the grant at once)
    assert plan(p, list(range(100))).local_prefill


def test_health_is_degraded_not_down_while_decode_prefills_alone() -> None:
    """/health answered 503 while requests were served (decode prefilling them): a load
    balancer would have dropped the router then."""
    from tandem.router.deployment import health_status

    assert health_status({"prefill": 1, "decode": 2}, False) == "ok"
    assert health_status({"prefill": 0, "decode": 1}, False) == "degraded"
    assert health_status({"prefill": 2, "decode": 0}, False) == "unavailable"
    assert health_status({"decode": 1}, False) == "ok"  # (colocated)
    assert health_status({"prefill": 1, "decode": 1}, True) == "stopping"
