"""A worker loop that has stopped refuses new commands at once: a command queued then would
never run, and its caller (Serve asking an autoscaling replica for its stats while the replica
stops) waited until its own timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem.engine.worker_loop import WorkerDeadError, WorkerLoop


class _IdleLoop(WorkerLoop):
    def run_once(self) -> None:
        self.wait_for_command()

    def stats(self) -> dict[str, Any]:
        return {"running": 0}

    def on_death(self, exc: BaseException) -> None:
        pass


def test_stats_of_a_stopped_loop_fail_at_once() -> None:
    async def main() -> None:
        loop = _IdleLoop("idle")
        loop.start()
        assert await asyncio.wait_for(loop.get_stats(), 5) == {"running": 0}
        loop.close()
        with pytest.raises(WorkerDeadError, match="idle is stopped"):
            await asyncio.wait_for(loop.get_stats(), 5)

    asyncio.run(main())
