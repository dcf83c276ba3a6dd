"""The router's side of one prefill call: the RPC that streams the early first token and then
the outcome, the grant that follows decode's reservation, and cutting the early first token
from decode's first item."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from tandem.engine.rpc import RPCError, RPCNotSent
from tandem.router.errors import APIError
from tandem.router.worker_directory import Worker

logger = logging.getLogger("tandem.router")


@dataclass
class PrefillCall:
    task: asyncio.Future[dict[str, Any]]  # the outcome
    early: asyncio.Future[dict[str, Any]]  # the first token, streamed as soon as sampled
    grant_task: asyncio.Future[None] | None = None  # hands decode's reservation over
    carries_grant: bool = False  # started with decode's reservation (not handed over after)

    def futures(self) -> set[asyncio.Future[Any]]:
        """What of the call to cancel when the request ends. Not the grant's hand-over: it
        runs to its end (`hand_grant`), so that the prefill worker learns of the reservation
        even after the call ended there, and tells the decode worker to free it at once."""
        return {self.task, self.early}

    def hand_grant(self, worker: Worker, request_id: str, grant: dict[str, Any]) -> None:
        """Sends decode's reservation to the prefill worker (`send_grant`), to the end."""
        task = self.grant_task = asyncio.ensure_future(send_grant(worker, request_id, grant))
        _handing.add(task)
        task.add_done_callback(_handing.discard)


_handing: set[asyncio.Future[None]] = set()  # strong references to grants being handed over


def start_prefill_call(
    worker: Worker,
    request_id: str,
    prompt: list[int],
    params: dict[str, Any],
    grant: dict[str, Any] | None,
    priority: int,
    finish_here: bool = False,
) -> PrefillCall:
    """With `finish_here` (a one-token request, no grant) the request ends on the prefill
    worker: its outcome is "finished" with the token item, and no early first token comes."""
    early: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        _prefill(worker, request_id, prompt, params, grant, priority, early, finish_here)
    )
    return PrefillCall(task, early, carries_grant=grant is not None)


async def send_grant(worker: Worker, request_id: str, grant: dict[str, Any]) -> None:
    """A refusal is the prefill call's to report (its outcome), so it is only logged here."""
    try:
        reply = await worker.client.call("grant", request_id=request_id, grant=grant)
    except RPCError as exc:
        reply = {"ok": False, "error": str(exc)}
    if not reply.get("ok"):
        logger.info("grant for %s not taken by %s: %s", request_id, worker.worker_id, reply)


async def _prefill(
    worker: Worker,
    request_id: str,
    prompt: list[int],
    params: dict[str, Any],
    grant: dict[str, Any] | None,
    priority: int,
    first_token: asyncio.Future[dict[str, Any]],
    finish_here: bool = False,
) -> dict[str, Any]:
    """The prefill call's outcome; its early first token (if any) resolves `first_token`."""
    how = {"finish_here": True} if finish_here else {"stream_first_token": True}
    call = worker.client.stream(
        "prefill",
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        grant=grant,
        priority=priority,
        **how,
    )
    try:
        async with contextlib.aclosing(call):
            async for item in call:
                if item.get("type") != "first_token":
                    return item
                if not first_token.done():
                    first_token.set_result(item)
    except RPCError as exc:
        failed: dict[str, Any] = {
            "status": "failed",
            "error": f"prefill worker {worker.worker_id}: {exc}",
        }
        if isinstance(exc, RPCNotSent):  # the worker never heard of it (nor of its grant)
            failed["not_sent"] = True
        return failed
    return {"status": "failed", "error": f"prefill worker {worker.worker_id} sent no outcome"}


def without_streamed(item: dict[str, Any], streamed: dict[str, Any]) -> dict[str, Any]:
    """Decode's first item without the first token the prefill worker already streamed."""
    ids, text = streamed["token_ids"], streamed["text"]
    if item["token_ids"][: len(ids)] != ids or not item["text"].startswith(text):
        raise APIError(
            500,
            f"prefill streamed first token {ids} ({text!r}) but decode continued from "
            f"{item['token_ids'][: len(ids)]} ({item['text'][: len(text)]!r})",
            type="internal_error",
            code="first_token_mismatch",
        )
    rest = {**item, "token_ids": item["token_ids"][len(ids) :], "text": item["text"][len(text) :]}
    if item.get("logprobs") is not None:
        rest["logprobs"] = item["logprobs"][len(ids) :]
    return rest
