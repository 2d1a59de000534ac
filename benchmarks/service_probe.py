"""Why a loop serving 64 tasks lags: the scan service under variations, on asyncio.

For each variation of the waiting layer (how many waits watch from the loop,
how many completions one wake-up resumes), the service of
``accy_async.bench.workload`` serves small prefix sums with 64 tasks while
every callback the loop runs is timed (``asyncio.events.Handle._run``): the
heartbeat's worst lag beside the longest callbacks, which task steps they were,
and how many took over 1 ms.

    python benchmarks/service_probe.py [OUT.json]
"""

from __future__ import annotations

import asyncio
import asyncio.events
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from accy_async import waiting
from accy_async._loops import _asyncio
from accy_async.bench import workload
from accy_async.bench.rig import Rig


@contextmanager
def timed_callbacks(record: list[tuple[float, str]]) -> Iterator[None]:
    """Time every callback the (pure-Python) asyncio loop runs."""
    original = asyncio.events.Handle._run

    def run(handle: asyncio.events.Handle) -> None:
        start = time.perf_counter()
        original(handle)
        record.append((time.perf_counter() - start, repr(handle)[:160]))

    asyncio.events.Handle._run = run  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        asyncio.events.Handle._run = original  # type: ignore[method-assign]


def variation(rig: Rig, watchers: int, chunk: int) -> dict[str, Any]:
    waiting.MAX_WATCHERS = watchers  # type: ignore[misc]
    _asyncio.WAKE_CHUNK = chunk  # type: ignore[misc]
    small = workload.service_workloads((1_000, 1_000_000), (100_000, 1_000_000), quick=True)[0]
    record: list[tuple[float, str]] = []
    max_n = workload.service_max_n(small.high, 64)
    with timed_callbacks(record):
        section = workload.run_on(
            "asyncio", workload._accy_service_rows, rig, "asyncio", [small], [64], max_n
        )
    row = next(iter(section[small.name].values()))
    record.sort(reverse=True)
    return {
        "max_watchers": watchers,
        "wake_chunk": chunk,
        "requests_per_s": row["requests_per_s"],
        "median_us": row["median_us"],
        "worst_heartbeat_lag_ms": row["worst_heartbeat_lag_ms"],
        "worst_gc_pause_ms": row["worst_gc_pause_ms"],
        "callbacks": len(record),
        "callbacks_over_1ms": sum(1 for seconds, _ in record if seconds > 1e-3),
        "callbacks_over_200us": sum(1 for seconds, _ in record if seconds > 200e-6),
        "longest": [(round(seconds * 1e6), what) for seconds, what in record[:6]],
    }


def main() -> None:
    rig = Rig()
    results = []
    try:
        for watchers, chunk in ((16, 8), (64, 8), (16, 2), (4, 2), (64, 64)):
            started = time.perf_counter()
            try:
                results.append(variation(rig, watchers, chunk))
            except Exception as exc:  # a variation that fails is reported, the rest run
                results.append({"max_watchers": watchers, "wake_chunk": chunk, "failed": repr(exc)})
            print(f"{watchers}/{chunk}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    finally:
        rig.close()
    text = json.dumps(results, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
