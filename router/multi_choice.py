"""Several choices in one OpenAI request: a batch of prompts (completions) and `n` > 1 samples.

Each choice is a request of its own through the cluster, with its own routing, reservation,
transfer and cancel, so its blocks come and go as any request's do. Choice i is sample
`i % n` of prompt `i // n` (OpenAI's and vLLM's numbering).

- The choices are prepared together and admitted all or none: when one is refused (a 4xx, or a
  429 for no room), the ones already reserved are abandoned before any token is generated.
- They then run at once. The first error in any choice ends the response and closes the others
  on their workers; so does a client that leaves.
- Seeded sampling gives sample j the seed `seed + j` (wrapped into the seed range): the
  samples differ from each other, and the same request gives the same choices again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from tandem.engine.seeds import sample_seed
from tandem.router.call_cleanup import to_completion
from tandem.router.errors import APIError, bad_request
from tandem.router.prepared import Prepared
from tandem.router.serving import Serving, run_to_end
from tandem.router.sibling_load import SiblingPlans

MAX_CHOICES = 128
"""Most choices (prompts x n) one request may ask for; more is a 400."""


def check_count(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} choices; "
            f"at most {MAX_CHOICES} per request",
            "n" if num_prompts == 1 else "prompt",
        )


def sample_fields(fields: dict[str, Any], sample: int) -> dict[str, Any]:
    """The sampling fields of sample `sample` (0-based) of a prompt."""
    seed = fields.get("seed")
    if seed is None or sample == 0:
        return fields
    return {**fields, "seed": sample_seed(seed, sample)}


async def prepare_all(
    serving: Serving,
    count: int,
    prepare: Callable[[int, SiblingPlans], Awaitable[Prepared]],
) -> list[Prepared]:
    """`prepare(i, siblings)` for every choice, at once, admitted as one request's
    (`sibling_load`). All are admitted or none: on any error (the first choice's in order is
    raised) or cancel, those that were admitted are abandoned."""
    siblings = SiblingPlans()
    tasks = [asyncio.ensure_future(prepare(i, siblings)) for i in range(count)]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await to_completion(_abandon_admitted(serving, tasks))
        raise
    errors = [t.exception() for t in tasks if t.exception() is not None]
    if errors:
        refused = errors[0]
        await to_completion(
            _abandon_admitted(serving, tasks, refused if isinstance(refused, APIError) else None)
        )
        raise refused  # type: ignore[misc]
    return [t.result() for t in tasks]


async def _abandon_admitted(
    serving: Serving, tasks: Sequence[asyncio.Future[Prepared]], refused: APIError | None = None
) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    admitted = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
    await abandon_all(serving, admitted, refused)


async def abandon_all(
    serving: Serving, reqs: list[Prepared], refused: APIError | None = None
) -> None:
    """Closes the calls of every request here that never started to run (`refused`: the
    error that ended their request, which counts each of them as it counted itself)."""
    await asyncio.gather(*(serving.abandon(r, refused) for r in reqs), return_exceptions=True)


async def run_all(serving: Serving, reqs: list[Prepared]) -> None:
    """Runs every request to its end (each `Prepared` takes its tokens); the first error,
    in choice order among those that failed first, ends them all."""
    tasks = [asyncio.ensure_future(run_to_end(serving, r)) for r in reqs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        await to_completion(_settle(serving, tasks, reqs))


async def merged(
    serving: Serving, reqs: list[Prepared]
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """(choice index, token item) of every request as they come; the first error ends them
    all (raised here), and so does closing this."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None, Exception | None]] = asyncio.Queue()

    async def pump(index: int, req: Prepared) -> None:
        try:
            async with contextlib.aclosing(serving.run(req)) as items:
                async for item in items:
                    queue.put_nowait((index, item, None))
        except Exception as exc:  # (APIError, ...) raised where the caller reads
            queue.put_nowait((index, None, exc))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        running = len(tasks)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
                continue
            yield index, item
    finally:
        await to_completion(_settle(serving, tasks, reqs))


async def _settle(
    serving: Serving, tasks: Sequence[asyncio.Future[None]], reqs: list[Prepared]
) -> None:
    """Cancels what still runs (closing each request on its workers) and abandons requests
    whose run never began."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await abandon_all(serving, reqs)
