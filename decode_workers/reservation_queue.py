"""Reservations that wait for KV room on a decode worker, in arrival order.

A prompt for which the decode engine has no free blocks now is not refused at once: it waits,
as a request waits in vLLM's queue, for blocks that running requests give back. Waiting
reservations hold no block. The head is tried again whenever more blocks are free than when it
last failed; one that waited `wait_s` is refused ("no_capacity", a 429 with Retry-After at the
router). Everything here runs on the decode worker's loop thread; each waiter's asyncio future
gets its grant, or a `WaitEnded` with the stream's error item.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.block_manager import BlockManager
from tandem.engine.kv_io import NoFreeBlocksError
from tandem.engine.worker_loop import resolve

logger = logging.getLogger(__name__)


class WaitEnded(Exception):
    """A waiting reservation ended without a grant; `item` is the stream's error item."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.item = {"type": "error", "code": code, "error": message}


@dataclass
class _Waiter:
    request_id: str
    prompt_tokens: int
    stream: Any  # what `reserve` takes (the decode service's per-request stream)
    granted: asyncio.Future[Any]
    until: float  # (time.monotonic())


class ReservationQueue:
    """`reserve(request_id, stream)` makes a grant or raises `NoFreeBlocksError`."""

    def __init__(
        self,
        reserve: Callable[[str, Any], Any],
        block_manager: BlockManager,
        block_size: int,
        wait_s: float,
    ) -> None:
        self.reserve = reserve
        self.block_manager = block_manager
        self.block_size = block_size
        self.wait_s = wait_s
        self._waiters: deque[_Waiter] = deque()
        self._retry_above_free = -1  # the head is tried again once more blocks are free

    def __len__(self) -> int:
        return len(self._waiters)

    def reserve_or_wait(
        self,
        request_id: str,
        prompt_tokens: int,
        stream: Any,
        granted: asyncio.Future[Any],
        may_wait: bool = True,
    ) -> Any:
        """The grant now, or None: the reservation waits (`granted` gets its outcome). Behind
        others that wait, it waits too. `NoFreeBlocksError` when it may not wait (`may_wait`
        false: a request with a deadline, refused at arrival; `wait_s` 0) or could never fit
        the pool."""
        if not self._waiters or not may_wait:
            try:
                return self.reserve(request_id, stream)
            except NoFreeBlocksError:
                blocks = -(-prompt_tokens // self.block_size)
                if not may_wait or self.wait_s <= 0 or blocks > self.block_manager.num_blocks:
                    raise
        until = time.monotonic() + self.wait_s
        self._waiters.append(_Waiter(request_id, prompt_tokens, stream, granted, until))
        logger.info(
            "decode: no KV room for %s now (%d tokens): it waits its turn (%d waiting)",
            request_id,
            prompt_tokens,
            len(self._waiters),
        )
        return None

    def grant_ready(self) -> None:
        """Grants waiting reservations in arrival order while blocks allow; refuses those that
        waited `wait_s`."""
        bm, waiters = self.block_manager, self._waiters
        while waiters and bm.num_free_blocks > self._retry_above_free:
            head = waiters[0]
            try:
                grant = self.reserve(head.request_id, head.stream)
            except NoFreeBlocksError:
                self._retry_above_free = bm.num_free_blocks
                break
            self._forget(head)
            resolve(head.granted.get_loop(), head.granted, grant)
        now = time.monotonic()
        for late in [w for w in waiters if now > w.until]:
            # (no request id: the router's is not the one its client knows)
            message = f"none came free within {self.wait_s:g} s"
            self._end(late, "no_capacity", message)

    def cancel(self, request_id: str) -> bool:
        """Forgets `request_id`'s waiting reservation (its stream closed); whether it had one."""
        for waiter in [w for w in self._waiters if w.request_id == request_id]:
            self._forget(waiter)
            return True
        return False

    def end_all(self, code: str, message: str) -> None:
        """Every waiting reservation ends with this error (a drain, the worker's death)."""
        for waiter in list(self._waiters):
            self._end(waiter, code, message)

    def _forget(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        self._retry_above_free = -1  # (another head, or fewer ahead: try at once)

    def _end(self, waiter: _Waiter, code: str, message: str) -> None:
        self._forget(waiter)
        resolve(waiter.granted.get_loop(), waiter.granted, WaitEnded(code, message))
