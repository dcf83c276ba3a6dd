"""The deadlines of the requests a router runs, which the router's own stop brings forward.

Every request ends by `request_timeout_s` (a 504). A router replica that Serve stops (a redeploy,
a scale-down) waits for its requests at most its `graceful_shutdown_timeout_s`, then Serve kills
its process: a stream still running then would end in a cut connection, with no error event,
no finish reason and no `[DONE]`. Brought forward to just before that kill, the deadlines end
those streams with a 503 that says why: their callers get the error and can send them again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tandem.router.errors import APIError, unavailable


class StreamDeadlines:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._running: set[asyncio.Timeout] = set()
        self._cut_at: float | None = None  # (the event loop's time)
        self._why = ""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[asyncio.Timeout]:
        """A request's deadline while it runs (TimeoutError when it passes)."""
        async with asyncio.timeout(self.timeout_s) as deadline:
            if self._cut_at is not None:
                _bring_forward(deadline, self._cut_at)
            self._running.add(deadline)
            try:
                yield deadline
            finally:
                self._running.discard(deadline)

    def cut_at(self, when: float, why: str) -> None:
        """Requests still running at loop time `when` end then, with a 503 that says `why`."""
        self._cut_at, self._why = when, why
        for deadline in self._running:
            _bring_forward(deadline, when)

    def timed_out(self, deadline: asyncio.Timeout) -> APIError:
        """The error of a request whose `deadline` passed: the stop's 503, or a 504."""
        when = deadline.when()
        if self._cut_at is not None and when is not None and when >= self._cut_at:
            return unavailable(self._why, "router_stopping")
        return APIError(504, f"request timed out after {self.timeout_s}s", type="timeout")

    @property
    def running_count(self) -> int:
        return len(self._running)


def _bring_forward(deadline: asyncio.Timeout, when: float) -> None:
    current = deadline.when()
    if current is None or current > when:
        deadline.reschedule(when)
