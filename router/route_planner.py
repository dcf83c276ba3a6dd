"""Where one request goes: the decode worker, the prefill worker (or none), admission (DESIGN §6).

- Decode: the worker that already holds the longest prefix of the request (a conversation's
  earlier turns) when it has room, else the least loaded. Only the blocks it lacks are
  transferred (its reservation skips what it caches).
- Conditional prefill: when that worker holds a prefix and the uncached tail is at most
  `conditional_prefill_max_tokens`, it prefills the tail itself; no prefill worker, no transfer.
- Prefill: the routing policy (cache affinity on the KV-event index by default).
- One token (max_tokens=1): the request ends on its prefill worker (`RoutePlan.prefill_only`);
  no decode worker is chosen or needed (such requests are served while none is live), decode
  reserves nothing, no pages move, and decode's load and admission are not involved.
- Admission: the plan's predicted TTFT against the request's deadline, and the queue cap.
- Colocated mode: there are no prefill workers; every request is prefilled locally by the
  decode worker chosen as above (the decode-side admission, and the deadline against the
  tail's prefill there).
- No live prefill worker in PD mode (the only one drains in a redeploy, or restarts after it
  died): requests are prefilled locally by their decode worker, as in colocated mode, instead
  of waiting for one (they waited, up to the replacement's start-up: 39 s on 2 cores).
A plan holds its load on the chosen workers (so concurrent arrivals see each other) until
`release()`; routing is synchronous and short, it never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.hashing import hash_full_blocks, salted_root
from tandem.router.admission import Admission, AdmissionConfig
from tandem.router.pending_prefixes import PendingPrefixes, merge_matches
from tandem.router.routing_policy import RoutingConfig, WorkerLoad, make_policy
from tandem.router.sibling_load import SiblingPlans, own_tokens
from tandem.router.worker_directory import Worker, WorkerDirectory

logger = logging.getLogger("tandem.router")


class DecodeRoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_kv_usage: float = Field(
        0.9, gt=0, le=1, description="a decode worker above this KV usage gets no new request"
    )
    conditional_prefill_max_tokens: int = Field(
        128, ge=0, description="uncached tail the holding decode worker prefills itself"
    )
    max_in_flight_gap: int = Field(
        4,
        ge=0,
        description="a decode worker holding the prompt's prefix keeps the request while it "
        "runs at most this many more requests than the least busy one (else that one takes it: "
        "a replica added by autoscaling gets traffic that shares a prefix)",
    )


@dataclass
class RoutePlan:
    decode: Worker | None  # None: a one-token request (`prefill_only`), decode is not used
    prefill: Worker | None  # None: the decode worker prefills locally
    prompt_blocks: int
    decode_hit_blocks: int
    prefill_hit_blocks: int
    prefill_tokens: int
    decode_tokens: int = 0  # prompt + max_tokens, held on the decode worker's queue
    decode_stream: Any = None  # the request's open decode call (`PDOrchestrator.reserve`)
    grant: dict[str, Any] | None = None  # the decode worker's reservation
    prefill_call: Any = None  # the prefill call started with the reservation (PDOrchestrator)
    grant_handed: bool = False  # a prefill worker may have the grant (it may write the blocks)
    hold_timer: asyncio.TimerHandle | None = None  # releases a plan whose request never ran
    wait_for_room: bool = True  # no deadline: with no KV room on decode now, wait for it
    _released_prefill: bool = False
    _released: bool = False

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None

    @property
    def prefill_only(self) -> bool:
        """A one-token request: it ends on its prefill worker, decode is not used."""
        return self.decode is None

    @property
    def decoder(self) -> Worker:
        """The decode worker of a plan that has one (every plan but a one-token request's)."""
        if self.decode is None:
            raise RuntimeError("a one-token request's plan has no decode worker")
        return self.decode

    @property
    def held(self) -> bool:
        """Its load still counts on its workers (`release`)."""
        return not self._released

    @property
    def prefill_pending(self) -> bool:
        """Its prefill tokens still count in a worker's prefill queue (`release_prefill`)."""
        return not self._released_prefill

    def release_prefill(self) -> None:
        """Prefill is done: its tokens no longer queue on the prefill worker (on the decode
        worker, for a prefill it runs itself)."""
        if self._released_prefill:
            return
        self._released_prefill = True
        if self.prefill is not None:
            self.prefill.queued_tokens -= self.prefill_tokens
            self.prefill.in_flight -= 1
        elif self.decode is not None:
            self.decode.queued_prefill_tokens -= self.prefill_tokens

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self.hold_timer is not None:
                self.hold_timer.cancel()
            self.release_prefill()
            if self.decode is not None:
                self.decode.in_flight -= 1
                self.decode.queued_tokens -= self.decode_tokens


class RoutePlanner:
    def __init__(
        self,
        directory: WorkerDirectory,
        routing: RoutingConfig,
        decode_routing: DecodeRoutingConfig,
        admission: AdmissionConfig,
        *,
        colocated: bool = False,
    ) -> None:
        self.directory = directory
        self.colocated = colocated
        self._prefill_was_live = True  # (said once when none is, and once when one is again)
        self.policy = make_policy(routing)
        self.policy_name = "colocated" if colocated else routing.policy
        self.pending = PendingPrefixes(routing.pending_ttl_s) if routing.pending_ttl_s else None
        self.decode_routing = decode_routing
        self.admission = Admission(admission)
        directory.on_worker_removed.append(self.policy.remove_worker)
        if self.pending is not None:
            directory.on_worker_removed.append(self.pending.remove_worker)

    async def plan(
        self,
        prompt_token_ids: list[int],
        info: dict[str, Any],
        deadline_ms: float | None,
        hold_s: float,
        max_tokens: int = 0,
        cache_salt: str | None = None,
        siblings: SiblingPlans | None = None,
    ) -> RoutePlan:
        """Chooses workers and admits (or raises 429/503). The plan's load is held until
        `release()`, or `hold_s` at most (a request that never runs gives it back). Without
        a deadline, a decode worker with no KV room now makes the request wait its turn
        (`RoutePlan.wait_for_room`). `cache_salt`: the request's (its blocks' hashes are
        salted, `hashing.salted_root`). `siblings`: the plans of the request's other choices,
        which admission takes for the request's own load (`sibling_load`); this one joins them."""
        bs = int(info["block_size"])
        namespace = str(info["namespace"])
        root = salted_root(int(info["root_hash"]), cache_salt)
        hashes = hash_full_blocks(root, prompt_token_ids, bs)
        if max_tokens == 1 and not self.colocated and self._prefill_live():  # (no decode
            # worker is needed, or chosen)
            plan = await self._plan_prefill(
                None, namespace, hashes, len(prompt_token_ids), bs, 0, deadline_ms, siblings
            )
        else:
            plan = await self._plan_decode(
                prompt_token_ids, namespace, hashes, bs, deadline_ms, max_tokens, siblings
            )
        if siblings is not None:
            siblings.plans.append(plan)
        plan.hold_timer = asyncio.get_running_loop().call_later(hold_s, plan.release)
        plan.wait_for_room = deadline_ms is None
        return plan

    async def _plan_decode(
        self,
        prompt_token_ids: list[int],
        namespace: str,
        hashes: list[int],
        bs: int,
        deadline_ms: float | None,
        max_tokens: int,
        siblings: SiblingPlans | None,
    ) -> RoutePlan:
        """The decode worker, and the prefill worker unless decode prefills the tail itself;
        admitted, the load held on both."""
        decode_workers = await self.directory.wait_for("decode")
        decode, decode_hits = self._choose_decode(
            decode_workers,
            self.directory.index.match(namespace, hashes, [w.worker_id for w in decode_workers]),
        )
        decode_tokens = len(prompt_token_ids) + max_tokens
        self.admission.check_decode(
            decode.queued_tokens, decode_tokens, own_tokens(siblings, decode.worker_id, "decode")
        )
        tail = len(prompt_token_ids) - decode_hits * bs
        num_blocks = -(-len(prompt_token_ids) // bs)
        if (
            self.colocated
            or (decode_hits > 0 and tail <= self.decode_routing.conditional_prefill_max_tokens)
            or not self._prefill_live()
        ):
            # (admitted as a prefill worker's: behind the prefills decode runs itself, which
            # colocated mode queues there; no transfer)
            rate = float(decode.stats.get("prefill_tokens_per_s") or 0) or None
            self.admission.check(
                queued_tokens=decode.queued_prefill_tokens, new_tokens=tail, tokens_per_s=rate,
                blocks=0, deadline_ms=deadline_ms,
                own_tokens=own_tokens(siblings, decode.worker_id, "decode_prefill"),
            )  # fmt: skip
            plan = RoutePlan(decode, None, num_blocks, decode_hits, 0, tail)
            decode.queued_prefill_tokens += tail
        else:
            plan = await self._plan_prefill(
                decode, namespace, hashes, len(prompt_token_ids), bs, decode_hits, deadline_ms,
                siblings,
            )  # fmt: skip
        decode.in_flight += 1
        decode.queued_tokens += decode_tokens
        plan.decode_tokens = decode_tokens
        return plan

    def _prefill_live(self) -> bool:
        """Whether a prefill worker can take a request now (none: decode prefills itself)."""
        live = bool(self.directory.live("prefill"))
        if live != self._prefill_was_live:
            self._prefill_was_live = live
            if live:
                logger.info("a prefill worker is live again: requests go through prefill")
            else:
                logger.warning("no live prefill worker: decode workers prefill new requests")
        return live

    async def _plan_prefill(
        self,
        decode: Worker | None,
        namespace: str,
        hashes: list[int],
        prompt_tokens: int,
        block_size: int,
        decode_hits: int,
        deadline_ms: float | None,
        siblings: SiblingPlans | None,
    ) -> RoutePlan:
        """The prefill worker (by the routing policy), admitted; its load held. `decode` None:
        a one-token request, whose pages go nowhere."""
        prefill_workers = await self.directory.wait_for("prefill")
        matched = None
        if self.policy.uses_prefix_match:
            ids = [w.worker_id for w in prefill_workers]
            matched = self.directory.index.match(namespace, hashes, ids)
            if self.pending is not None:
                matched = merge_matches(matched, self.pending.match(namespace, hashes, ids))
        loads = {
            w.worker_id: WorkerLoad(w.worker_id, w.queued_tokens, w.in_flight)
            for w in prefill_workers
        }
        prefill = self.directory.workers[self.policy.choose(loads, matched)]
        if self.pending is not None:
            self.pending.record(prefill.worker_id, namespace, hashes)
        prefill_hits = (matched or {}).get(prefill.worker_id, 0)
        new_tokens = prompt_tokens - prefill_hits * block_size
        num_blocks = -(-prompt_tokens // block_size)
        self.admission.check(
            queued_tokens=prefill.queued_tokens,
            new_tokens=new_tokens,
            tokens_per_s=float(prefill.stats.get("prefill_tokens_per_s") or 0) or None,
            blocks=0 if decode is None else num_blocks - decode_hits,  # (pages sent)
            deadline_ms=deadline_ms,
            own_tokens=own_tokens(siblings, prefill.worker_id, "prefill"),
        )
        plan = RoutePlan(decode, prefill, num_blocks, decode_hits, prefill_hits, new_tokens)
        prefill.queued_tokens += new_tokens
        prefill.in_flight += 1
        return plan

    def _choose_decode(self, workers: list[Worker], matched: dict[str, int]) -> tuple[Worker, int]:
        max_usage = self.decode_routing.max_kv_usage
        roomy = [w for w in workers if float(w.stats.get("kv_cache_usage", 0)) < max_usage]
        candidates = roomy or workers
        holders = [w for w in candidates if matched.get(w.worker_id, 0) > 0]
        idlest = min(candidates, key=Worker.load)
        if holders:
            best = max(holders, key=lambda w: (matched[w.worker_id], -w.in_flight))
            if best.in_flight - idlest.in_flight <= self.decode_routing.max_in_flight_gap:
                return best, matched[best.worker_id]
        return idlest, matched.get(idlest.worker_id, 0)
