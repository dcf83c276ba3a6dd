"""The choices of one request (`n` > 1 samples, a batch of prompts) are admitted as one: the
admission caps let a request past a full queue only when the queue holds nobody else's
tokens, and a choice's siblings are not somebody else. Without this, choices 2.. of a request
whose prompt alone fills the cap saw choice 1's tokens queued and were refused with a 429 on
an idle cluster, each retry alike (the choices are admitted all or none).

The choices are planned in tasks `multi_choice.prepare_all` starts inside `choices_of_one_request`:
each task's context carries the same `SiblingLoad`, which the planner reads and adds to."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

Queue = Literal["prefill", "decode", "decode_prefill"]
"""A worker's load counters: prefill's queued prompt tokens, decode's held tokens, and the
prompt tokens decode prefills itself (`Worker.queued_tokens` / `queued_prefill_tokens`)."""


class SiblingLoad:
    """The tokens one request's choices have put on each worker's queues so far."""

    def __init__(self) -> None:
        self.tokens: Counter[tuple[str, Queue]] = Counter()


_SIBLINGS: ContextVar[SiblingLoad | None] = ContextVar("tandem_sibling_load", default=None)


@contextmanager
def choices_of_one_request() -> Iterator[None]:
    """Tasks started inside plan their choices as siblings."""
    token = _SIBLINGS.set(SiblingLoad())
    try:
        yield
    finally:
        _SIBLINGS.reset(token)


def own_tokens(worker_id: str, queue: Queue) -> int:
    """Tokens this request's other choices hold on `worker_id`'s `queue` (0: a lone request)."""
    load = _SIBLINGS.get()
    return 0 if load is None else load.tokens[(worker_id, queue)]


def add_own(worker_id: str, queue: Queue, tokens: int) -> None:
    load = _SIBLINGS.get()
    if load is not None:
        load.tokens[(worker_id, queue)] += tokens
