"""The scheduler: one rule, a token budget per step (DESIGN §4).

Every request has `num_computed_tokens` that catches up with `num_tokens`. Each step:
1. running requests that decode (one token behind) are scheduled first, for steady ITL; when the
   pool has no block for one of them, the newest running request is preempted (recompute), but
   for one whose pages a KV transfer holds (`keep_kv`: it got blocks for its whole prompt when
   admitted, and is passed over);
2. running requests still in prefill get a chunk of what budget is left; one with no block for
   its chunk preempts the newest running request after it not scheduled this step (the oldest
   prefill always goes on), else waits;
3. waiting requests are admitted (not in a step that preempted, as in vLLM) by priority (lower
   first), then in arrival order (a preempted request goes back by its own arrival):
   prefix-cache hits advance them for free, the rest of their prompt is prefilled in chunks
   that fit the budget, up to `max_num_seqs`.

With `enable_chunked_prefill=False` (vLLM's switch) a prompt is prefilled whole or not at all:
it is admitted only when its uncached tokens fit the budget left, and the queue waits behind it
otherwise. A prompt longer than the whole budget is admitted whole when it is the only prompt
of its step (with that step's decodes), so it never starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.engine.block_manager import BlockManager
from tandem.engine.hashing import hash_full_blocks, salted_root
from tandem.engine.request import Request, RequestStatus

PROMPT_LOGPROBS_CHUNK = 256
"""Most prompt tokens a step computes of a request whose prompt logprobs are asked."""


@dataclass
class SchedulerOutput:
    """What the model runs this step: (request, number of new tokens) in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        root_hash: int,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.root_hash = root_hash
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.set_status(RequestStatus.QUEUED)
        self._wait(request)

    def _wait(self, request: Request) -> None:
        """Into the waiting queue, ordered by (priority, arrival) as vLLM's priority queue (a
        new request goes last of its priority; a preempted one back by its own arrival)."""
        key = _order(request)
        i = len(self.waiting)
        while i > 0 and _order(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, request)

    def add_running(self, request: Request) -> None:
        """Adds a request whose KV is already in the pool (imported from a prefill engine)."""
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Takes a request out of the queues and frees its blocks unless it keeps its KV."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if not request.keep_kv:
            self.free_blocks(request)

    def free_blocks(self, request: Request) -> None:
        if request.block_table:
            self.block_manager.free(request.block_table)
            request.block_table = []
        request.num_cached_blocks = 0

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget, decode=True)
        budget = self._schedule_running(out, budget, decode=False)
        if not out.preempted:  # (what was just preempted is not admitted again at once)
            self._admit_waiting(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, *, decode: bool) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            remaining = req.num_tokens - req.num_computed_tokens
            if (remaining == 1) != decode or remaining <= 0:
                continue
            n = min(remaining, budget)
            if not decode:
                n = self._cap_for_prompt_logprobs(req, n)
                if n < remaining and not self.enable_chunked_prefill:
                    continue
            while not bm.allocate(req.block_table, req.num_computed_tokens + n):
                victim = self._pop_victim(req, out, or_itself=decode)
                if victim is None:  # (a prefill chunk waits for what older requests give back)
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        admitted = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit_blocks = self._lookup_prefix(req)
            num_hit = len(hit_blocks) * self.block_size
            n = self._cap_for_prompt_logprobs(req, min(req.num_tokens - num_hit, budget))
            if not self.enable_chunked_prefill and n < req.num_tokens - num_hit:
                oversized = req.num_tokens - num_hit > self.max_num_batched_tokens
                prompt_in_step = any(k > 1 for _, k in out.scheduled)
                if not oversized or admitted or prompt_in_step:
                    req.status = RequestStatus.QUEUED
                    break
                n = req.num_tokens - num_hit  # whole, the only prompt of this step
            # A request whose pages go to a decode engine (`keep_kv`) gets blocks for its whole
            # prompt now: it never asks for one mid-prefill, so it is never a deadlock's half
            # (the pages it sent stay pinned until decode acknowledges its last chunk).
            upto = req.num_tokens if req.keep_kv else num_hit + n
            if not bm.allocate(req.block_table, upto, hit_blocks):
                req.status = RequestStatus.QUEUED  # still waiting; the lookup is redone next step
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            req.num_cached_blocks = len(hit_blocks)
            if req.num_preemptions == 0:  # counted once per request, when it is admitted
                req.num_prefix_hit_tokens = num_hit
                if self.enable_prefix_caching:
                    bm.record_lookup(req.num_tokens // self.block_size, len(hit_blocks))
            req.set_status(RequestStatus.PREFILLING)
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
            admitted += 1
        return max(budget, 0)

    def _cap_for_prompt_logprobs(self, req: Request, n: int) -> int:
        """A prompt whose logprobs are asked goes in chunks of at most PROMPT_LOGPROBS_CHUNK
        tokens (each of its positions needs a vocabulary-wide row of logits)."""
        if self.enable_chunked_prefill and req.wants_prompt_logprobs:
            return min(n, PROMPT_LOGPROBS_CHUNK)
        return n

    def _lookup_prefix(self, req: Request) -> list[int]:
        """Cached full blocks of the request's tokens, leaving at least one token to compute
        (none for a request whose prompt logprobs are still to compute)."""
        if not self.enable_prefix_caching or req.wants_prompt_logprobs:
            return []
        req.set_status(RequestStatus.PREFIX_LOOKUP)
        self._extend_hashes(req, req.num_tokens)
        hits = self.block_manager.match_prefix(req.block_hashes, req.token_ids, record=False)
        return hits[: (req.num_tokens - 1) // self.block_size]

    def _pop_victim(self, req: Request, out: SchedulerOutput, *, or_itself: bool) -> Request | None:
        """What `req`, short of a block, preempts: the newest running request after it that
        this step has not scheduled and whose pages no KV transfer holds (preempting one that
        streams them would free none of those it sent); else `req` itself (`or_itself`: a
        decode) or None (a prefill chunk: it waits). So the oldest prefill always goes on: two
        half-prefilled prompts that each wait for the other's blocks would wait forever."""
        scheduled = {id(r) for r, _ in out.scheduled}
        for i in range(len(self.running) - 1, -1, -1):
            candidate = self.running[i]
            if candidate is req:
                return self.running.pop(i) if or_itself else None
            if not candidate.keep_kv and id(candidate) not in scheduled:
                return self.running.pop(i)
        raise AssertionError("the request to schedule is not running")

    def _preempt(self, req: Request) -> None:
        self.free_blocks(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.set_status(RequestStatus.QUEUED)
        self._wait(req)

    # ---- after the model ran --------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Credits computed tokens and registers newly full blocks in the prefix cache."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            if self.enable_prefix_caching:
                full = req.num_computed_tokens // self.block_size
                if full > req.num_cached_blocks:
                    self._extend_hashes(req, full * self.block_size)
                    req.num_cached_blocks = self.block_manager.cache_blocks(
                        req.block_table,
                        req.block_hashes[:full],
                        req.token_ids,
                        req.num_cached_blocks,
                    )

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        have = len(req.block_hashes)
        if (have + 1) * self.block_size > num_tokens:
            return
        parent = (
            req.block_hashes[-1] if have else salted_root(self.root_hash, req.params.cache_salt)
        )
        req.block_hashes.extend(
            hash_full_blocks(
                self.root_hash,
                req.token_ids[:num_tokens],
                self.block_size,
                start_block=have,
                parent=parent,
            )
        )


def _order(request: Request) -> tuple[int, float]:
    """Where a request waits: by priority, then arrival."""
    return request.priority, request.timestamps[RequestStatus.NEW]
