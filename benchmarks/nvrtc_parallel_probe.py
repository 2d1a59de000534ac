"""Does NVRTC compile in parallel from Python threads, and does it stall the event loop?

Compiles ``--count`` distinct copies of a small kernel one after another, then
all at once from a thread pool, then from a process pool (each warmed up
first), and measures an event loop's worst heartbeat lag while kernels compile
in worker threads and in worker processes. Prints JSON. Usage::

    python benchmarks/nvrtc_parallel_probe.py [--count 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import anyio
import anyio.to_process
import anyio.to_thread

from accy_async.backends.cuda.nvrtc import compile_source
from accy_async.library import cuda_source

SOURCE = cuda_source("reduce")


def compile_one(salt: str) -> int:
    image = compile_source(SOURCE, "partial_sum", ("-DACCY_T=float", f"-DSALT={salt}"), (9, 0))
    return len(image.image)


async def heartbeat_lag(way: str, count: int, stamp: int) -> dict[str, float]:
    """Worst and median lag of a 1 ms heartbeat while ``count`` kernels compile ``way``."""
    lags: list[float] = []
    done = anyio.Event()

    async def heartbeat() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - before - 0.001)

    async def compile_all() -> None:
        async with anyio.create_task_group() as group:
            for i in range(count):
                salt = f"{way}{stamp}{i}"
                if way == "thread":
                    group.start_soon(anyio.to_thread.run_sync, compile_one, salt)
                else:
                    group.start_soon(anyio.to_process.run_sync, compile_one, salt)
        done.set()

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(heartbeat)
        group.start_soon(compile_all)
    lags.sort()
    return {
        "wall_s": time.perf_counter() - start,
        "worst_lag_ms": lags[-1] * 1e3,
        "median_lag_ms": lags[len(lags) // 2] * 1e3,
    }


async def loop_probe(count: int) -> dict[str, object]:
    stamp = time.time_ns()
    await anyio.to_process.run_sync(compile_one, f"warm{stamp}")  # start a worker
    return {
        "thread": await heartbeat_lag("thread", count, stamp),
        "process": await heartbeat_lag("process", count, stamp),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=32)
    args = parser.parse_args()
    workers = os.cpu_count() or 1
    stamp = time.time_ns()
    report: dict[str, object] = {"count": args.count, "workers": workers}
    start = time.perf_counter()
    compile_one(f"first{stamp}")
    report["first_compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(args.count):
        compile_one(f"s{stamp}{i}")
    report["sequential_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(compile_one, [f"t{stamp}{i}" for i in range(args.count)]))
    report["threads_s"] = time.perf_counter() - start
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(compile_one, [f"w{stamp}{i}" for i in range(workers)]))  # start them
        start = time.perf_counter()
        list(pool.map(compile_one, [f"p{stamp}{i}" for i in range(args.count)]))
        report["processes_s"] = time.perf_counter() - start
    report["event_loop"] = anyio.run(loop_probe, 8)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
