"""A task that ticks every millisecond beside the code under test and remembers its worst lag."""

from __future__ import annotations

import time

import anyio
import anyio.abc


class Heartbeat:
    """Ticks every millisecond and remembers the worst lateness."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.ticks = 0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - start - 0.001)
            self.ticks += 1
