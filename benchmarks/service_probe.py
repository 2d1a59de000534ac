"""Why a loop serving 64 tasks lags, and where a wait's CPU goes: probes on asyncio.

1. The scan service of ``accy_bench.service`` serves small prefix sums
   with 64 tasks while every callback the loop runs is timed
   (``asyncio.events.Handle._run``) and a watchdog thread records the loop
   thread's stack whenever one callback has run for over 2 ms: the heartbeat's
   worst lag beside the longest callbacks and what they were doing.
2. ``cProfile`` of a completion row (balanced and frugal waits on kernels of
   random length): the functions that take the CPU of a wait.

    python benchmarks/service_probe.py [OUT.json]
"""

from __future__ import annotations

import asyncio
import asyncio.events
import cProfile
import io
import json
import pstats
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from accy_async import waiting
from accy_async._loops import _base
from accy_bench import completion, service
from accy_bench.rig import Rig, run_on


@contextmanager
def timed_callbacks(record: list[tuple[float, str]], stacks: dict[str, int]) -> Iterator[None]:
    """Time every callback the (pure-Python) asyncio loop runs; sample the long ones' stacks."""
    original = asyncio.events.Handle._run
    running: list[float] = [0.0]
    loop_thread = threading.get_ident()
    stop = threading.Event()

    def run(handle: asyncio.events.Handle) -> None:
        start = running[0] = time.perf_counter()
        original(handle)
        running[0] = 0.0
        record.append((time.perf_counter() - start, repr(handle)[:160]))

    def watchdog() -> None:
        while not stop.wait(0.0005):
            started = running[0]
            if started and time.perf_counter() - started > 2e-3:
                frame = sys._current_frames().get(loop_thread)
                if frame is not None:
                    stack = "".join(traceback.format_stack(frame)[-8:])
                    stacks[stack] = stacks.get(stack, 0) + 1

    asyncio.events.Handle._run = run  # type: ignore[method-assign, assignment]
    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        asyncio.events.Handle._run = original  # type: ignore[method-assign]


def variation(
    rig: Rig, watchers: int, chunk: int, admitted: int, sizes: tuple[int, int]
) -> dict[str, Any]:
    waiting.MAX_WATCHERS = watchers  # type: ignore[misc]
    _base.WAKE_CHUNK = chunk  # type: ignore[misc]
    _base.ADMITTED_PER_PASS = admitted  # type: ignore[misc]
    small = service.service_workloads(sizes, sizes, quick=True)[0]
    record: list[tuple[float, str]] = []
    stacks: dict[str, int] = {}
    max_n = service.service_max_n(small.high, 64)
    with timed_callbacks(record, stacks):
        section = run_on("asyncio", service.accy_service_rows, rig, "asyncio", [small], [64], max_n)
    row = next(iter(section[small.name].values()))
    record.sort(reverse=True)
    return {
        "max_watchers": watchers,
        "wake_chunk": chunk,
        "admitted_per_pass": admitted,
        "sizes": sizes,
        "requests_per_s": row["requests_per_s"],
        "median_us": row["median_us"],
        "worst_heartbeat_lag_ms": row["worst_heartbeat_lag_ms"],
        "worst_gc_pause_ms": row["worst_gc_pause_ms"],
        "callbacks": len(record),
        "callbacks_over_1ms": sum(1 for seconds, _ in record if seconds > 1e-3),
        "callbacks_over_200us": sum(1 for seconds, _ in record if seconds > 200e-6),
        "longest": [(round(seconds * 1e6), what) for seconds, what in record[:6]],
        "stacks_of_callbacks_over_2ms": sorted(stacks.items(), key=lambda kv: -kv[1])[:6],
    }


def profile_waits(rig: Rig, policy: str) -> list[str]:
    """The top functions (own time) of accy waits on random-length kernels."""
    method = completion.AccyMethod(f"accy wait_event, {policy}", "event", policy)  # type: ignore[arg-type]
    random_lengths = completion.COMPLETION_WORKLOADS[2]
    draws = {random_lengths.name: completion.trial_lengths(random_lengths)[:60]}
    profiler = cProfile.Profile()

    async def body() -> Any:
        profiler.enable()
        try:
            return await completion.accy_completion(rig, "row", method, [random_lengths], draws)
        finally:
            profiler.disable()

    run_on("asyncio", body)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue().splitlines()


def main() -> None:
    rig = Rig()
    results: list[Any] = []
    try:
        for sizes in ((1_000, 1_000_000), (100_000, 30_000_000)):
            for watchers, chunk, admitted in ((16, 8, 4), (16, 4, 2), (64, 4, 2), (16, 8, 8)):
                started = time.perf_counter()
                try:
                    results.append(variation(rig, watchers, chunk, admitted, sizes))
                except Exception as exc:  # a variation that fails is reported, the rest run
                    results.append({"variation": (watchers, chunk, admitted), "failed": repr(exc)})
                print(f"{watchers}/{chunk}/{admitted}: {time.perf_counter() - started:.1f} s")
    finally:
        rig.close()
    text = json.dumps(results, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
