"""The choices of one request (`n` > 1 samples, a batch of prompts) are admitted as one: the
admission caps let a request past a full queue only when the queue holds nobody else's
tokens, and a choice's siblings are not somebody else. Without this, choices 2.. of a request
whose prompt alone fills the cap saw choice 1's tokens queued and were refused with a 429 on
an idle cluster, each retry alike (the choices are admitted all or none).

`multi_choice.prepare_all` gives every choice of a request the same `SiblingPlans`; the
planner adds each plan to it, and reads the load the ones still held put on a worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from tandem.router.route_planner import RoutePlan

Queue = Literal["prefill", "decode", "decode_prefill"]
"""A worker's load counters: prefill's queued prompt tokens, decode's held tokens, and the
prompt tokens decode prefills itself (`Worker.queued_tokens` / `queued_prefill_tokens`)."""


class SiblingPlans:
    """The route plans of one request's choices so far."""

    def __init__(self) -> None:
        self.plans: list[RoutePlan] = []

    def own_tokens(self, worker_id: str, queue: Queue) -> int:
        """The tokens the plans still held put on `worker_id`'s `queue` (a released plan's, or
        a plan moved elsewhere, no longer count)."""
        total = 0
        for plan in self.plans:
            if queue == "prefill":
                worker, tokens, counts = plan.prefill, plan.prefill_tokens, plan.prefill_pending
            elif queue == "decode_prefill":  # (a prefill the decode worker runs itself)
                worker = plan.decode if plan.prefill is None else None
                tokens, counts = plan.prefill_tokens, plan.prefill_pending
            else:
                worker, tokens, counts = plan.decode, plan.decode_tokens, plan.held
            if counts and worker is not None and worker.worker_id == worker_id:
                total += tokens
        return total


def own_tokens(siblings: SiblingPlans | None, worker_id: str, queue: Queue) -> int:
    """`siblings.own_tokens` (0 for a request of one choice)."""
    return 0 if siblings is None else siblings.own_tokens(worker_id, queue)
