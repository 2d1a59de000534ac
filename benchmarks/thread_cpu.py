"""Which threads spend CPU while accy-async waits for 2 ms kernels (diagnostic).

python benchmarks/thread_cpu.py 1|0   (anticipation on or off)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import anyio

from accy_async.backends.cuda import CudaBackend
from accy_async.waiting import wait_event
from accy_bench import Rig


def thread_times() -> dict[str, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    result = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        utime, stime = int(fields[11]), int(fields[12])
        result[f"{tid}:{names.get(int(tid), '?')}"] = (utime + stime) / ticks
    return result


async def main(anticipation: bool) -> None:
    rig = Rig()
    backend = CudaBackend(anticipation=anticipation)
    stream, event = backend.create_stream(), backend.create_event()
    before, start = thread_times(), time.perf_counter()
    for _ in range(200):
        rig.launch_spin(2_000_000, stream.native)
        backend.record_event(event, stream)
        await wait_event(backend, event)
    wall = time.perf_counter() - start
    after = thread_times()
    used: dict[str, Any] = {k: round((after[k] - before.get(k, 0)) / wall, 3) for k in after}
    print("anticipation", anticipation, {k: v for k, v in used.items() if v > 0.01}, flush=True)
    backend.destroy_all([stream, event])
    await backend.aclose()
    rig.close()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] != "0")
