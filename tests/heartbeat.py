"""A task that ticks every millisecond beside the code under test and remembers its worst lag."""

from __future__ import annotations

import time

import anyio
import anyio.abc


class Heartbeat:
    """Ticks every millisecond and remembers the worst lateness, in wall time and in CPU time.

    ``worst`` is how late the latest tick came (wall time); ``worst_cpu`` is the
    most CPU time the loop's thread spent between two ticks beyond the
    millisecond. A task that keeps the loop from its other tasks burns the
    loop's thread all that time, so both grow alike; a loaded machine that
    takes the CPU away from the whole process delays ticks without adding
    loop-thread CPU time, so only ``worst`` grows.
    """

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_cpu = 0.0
        self.ticks = 0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            start, start_cpu = time.perf_counter(), time.thread_time()
            await anyio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - start - 0.001)
            self.worst_cpu = max(self.worst_cpu, time.thread_time() - start_cpu - 0.001)
            self.ticks += 1
