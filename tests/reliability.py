"""The scenarios the reliability sweeps run, the load test, and the report that regenerates
``docs/reliability.md``::

    python -m tests.reliability            # print the figures
    python -m tests.reliability --write    # and rewrite docs/reliability.md (make reliability)

Each scenario does what a caller does (allocate its buffers, launch, read the result,
release its buffers with ``release_when_idle``, which waits shielded for the device) and
returns a checksum of
the result, so runs that finish are also checked for the right answer.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import sniffio

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.graph import launch_graph
from accy_async.kernels import SlotBinding, load_kernels
from accy_async.pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    choose_format,
    launch_pipeline,
    load_pipeline_artifacts,
)
from accy_async.testing import CancellationReport, FaultReport, cancellation_sweep, fault_sweep
from accy_async.tuning import Tuner
from accy_async.waiting import release_when_idle

from .plans import artifact_plan, diamond, elementwise_kernels, geometry, planned
from .tuning_fixtures import QUICK, probe_problem

N = 1000
SCAN = library.prefix_sum(p.DType.F32, 64)
SAXPY = library.saxpy(p.DType.F32)


async def pipeline_scenario(backend: accy.Backend) -> float:
    """A pipeline launch that allocates its intermediates and loads its kernels itself."""
    x = backend.allocate_buffer(4 * N)
    owned: list[Any] = [x]
    try:
        y = backend.allocate_buffer(4 * N)
        owned.append(y)
        backend.write_buffer(x, np.ones(N, np.float32).tobytes())
        await launch_pipeline(
            backend,
            PipelineLaunch(
                pipeline=SCAN.pipeline,
                registry=SCAN.registry,
                format=choose_format(backend, SCAN),
                operands=[x.bind("read_only")],
                results=[y.bind()],
                runtime_scalar_arguments=(p.U32(N),),
            ),
        )
        data = await accy.wait_read(backend.enqueue_read(y))
        return float(np.frombuffer(data, np.float32).sum())
    finally:
        await release_when_idle(backend, owned, [None])


def graph_plan(backend: accy.Backend) -> p.ArtifactPlan:
    """iota -> copy, iota -> add_one, (copy, add_one) -> add: a diamond over four kernels."""
    return artifact_plan(
        dict.fromkeys((1, 2, 3, 4), 4 * N),
        planned(
            backend,
            10,
            "iota_f32",
            1,
            scalars=(p.U32(N), p.F32(0.0)),
            launch_resources=geometry(N),
        ),
        *elementwise_kernels(backend, N),
    )


DIAMOND = diamond((0, 1, 2, 1))
EXPECTED_GRAPH = float(sum(2 * i + 1 for i in range(N)))


async def graph_scenario(backend: accy.Backend) -> float:
    """A kernel load and a launch graph on three streams, joined by device-side events."""
    return await _diamond_runs(backend, device_graph=False, runs=1)


async def _diamond_runs(backend: accy.Backend, *, device_graph: bool, runs: int) -> float:
    """Load the diamond's kernels, launch it ``runs`` times, read its result."""
    owned: list[Any] = []
    try:
        owned.extend(backend.allocate_buffer(4 * N) for _ in range(4))
        bindings = [
            SlotBinding(slot, b.bind()) for slot, b in zip((1, 2, 3, 4), owned, strict=True)
        ]
        async with await load_kernels(backend, graph_plan(backend)) as kernels:
            for _ in range(runs):
                run = await launch_graph(kernels, bindings, DIAMOND, device_graph=device_graph)
                await run.wait()
        data = await accy.wait_read(backend.enqueue_read(owned[3]))
        return float(np.frombuffer(data, np.float32).sum())
    finally:
        await release_when_idle(backend, owned, [None])


async def pipeline_graph_scenario(backend: accy.Backend) -> float:
    """A pool and scratch; a request launched twice (the second time as one device graph),
    then the same stages forced into a graph with new buffers (every node patched)."""
    owned: list[Any] = []
    try:
        owned.extend(backend.allocate_buffer(4 * N) for _ in range(3))  # kept as made
        x, y, z = owned
        backend.write_buffer(x, np.ones(N, np.float32).tobytes())
        fmt = choose_format(backend, SCAN)
        async with (
            await load_pipeline_artifacts(backend, SCAN.pipeline, SCAN.registry, fmt) as pool,
            await allocate_pipeline_intermediates(backend, SCAN.pipeline, (p.U32(N),)) as scratch,
        ):
            request = PipelineLaunch(
                pipeline=SCAN.pipeline,
                registry=SCAN.registry,
                format=fmt,
                operands=(x.bind("read_only"),),
                results=(y.bind(),),
                runtime_scalar_arguments=(p.U32(N),),
                intermediates=scratch,
                artifacts=pool,
            )
            await launch_pipeline(backend, request)
            await launch_pipeline(backend, request)
            forced = msgspec.structs.replace(request, results=(z.bind(),), device_graph=True)
            await launch_pipeline(backend, forced)
            await accy.wait_stream(backend)
        first = np.frombuffer(await accy.wait_read(backend.enqueue_read(y)), np.float32)
        second = np.frombuffer(await accy.wait_read(backend.enqueue_read(z)), np.float32)
        return float(first.sum() + second.sum())
    finally:
        await release_when_idle(backend, owned, [None])


async def device_graph_scenario(backend: accy.Backend) -> float:
    """The diamond on three streams as one device graph, launched twice."""
    return await _diamond_runs(backend, device_graph=True, runs=2)


async def kernel_scenario(backend: accy.Backend) -> float:
    """Load an artifact plan's kernels and launch one."""
    buffer = backend.allocate_buffer(4 * N)
    try:
        async with await load_kernels(backend, graph_plan(backend)) as kernels:
            kernels.launch_kernel(0, [SlotBinding(1, buffer.bind())])
        data = await accy.wait_read(backend.enqueue_read(buffer))
        return float(np.frombuffer(data, np.float32).sum())
    finally:
        await release_when_idle(backend, [buffer], [None])


async def tuning_scenario(backend: accy.Backend) -> int | None:
    """Tune the probe kernel (CPU) over six candidates."""
    async with Tuner(backend, settings=QUICK) as tuner:
        result = await tuner.tune(probe_problem(blocks=(64, 128, 256)))
    return result.winner


SCENARIOS: dict[str, Callable[[accy.Backend], Awaitable[Any]]] = {
    "pipeline launch": pipeline_scenario,
    "graph launch": graph_scenario,
    "kernel load": kernel_scenario,
    "pipeline as a device graph": pipeline_graph_scenario,
    "launch graph as a device graph": device_graph_scenario,
}
EXPECTED: dict[str, Any] = {
    "pipeline launch": float(N * (N + 1) // 2),
    "graph launch": EXPECTED_GRAPH,
    "kernel load": float(N * (N - 1) // 2),
    "pipeline as a device graph": float(N * (N + 1)),
    "launch graph as a device graph": EXPECTED_GRAPH,
    "tuning": 1,
}


async def run_fault_sweeps() -> list[FaultReport]:
    """Every default fault kind at every N, for each scenario."""
    return [await fault_sweep(s, name=name) for name, s in SCENARIOS.items()]


async def run_cancellation_sweeps(
    ways: tuple[str, ...] = ("scope", "timeout", "task"),
) -> list[CancellationReport]:
    """Each scenario and tuning on the CPU backend, cancelled at every checkpoint, every way."""
    reports = []
    library_name = sniffio.current_async_library()
    async with accy.open_backend("cpu") as backend:
        for name, scenario in [*SCENARIOS.items(), ("tuning", tuning_scenario)]:
            for way in ways:
                if way == "task" and library_name != "asyncio":
                    continue
                expected = EXPECTED[name]
                reports.append(
                    await cancellation_sweep(
                        scenario,
                        backend,
                        name=name,
                        way=way,  # type: ignore[arg-type]
                        check=equals(expected),
                    )
                )
    return reports


def equals(expected: Any) -> Callable[[Any], bool]:
    """A check that a finished run returned ``expected``."""

    def check(result: Any) -> bool:
        return bool(result == expected)

    return check


@dataclass
class LoadReport:
    callers: int
    pipelines_each: int
    launches: int
    wrong: int
    seconds: float
    worst_lag_ms: float
    median_lag_ms: float
    blocks_before: int
    blocks_after: int
    live_after: int
    tuned_gc: bool
    cyclic_garbage: int


async def load_test(
    callers: int = 1000, each: int = 10, n: int = 256, streams: int = 2, tuned_gc: bool = True
) -> LoadReport:
    """``callers`` tasks each running ``each`` pipelines on the CPU backend, checksummed.

    Callers arrive over a few loop iterations (the spawner yields every 5) and share
    ``streams`` streams; a 1 ms heartbeat measures the loop's lag. Python's allocated
    blocks are counted before the backend opens and after it closes
    (``sys.getallocatedblocks``, after a full collection; run it once before to warm the
    library's bounded caches). ``tuned_gc`` does what the README recommends for
    latency-sensitive services: ``gc.freeze()`` after set-up and the cyclic collector
    paused for the burst (a collection walks every live object of the thousand callers,
    pausing the loop for 10-30 ms on a 2-core machine). ``cyclic_garbage`` is what a full
    collection right after the burst finds: with the collector paused, every reference
    cycle the burst made.
    """
    document = SAXPY
    lags: list[float] = []
    wrong = 0
    gc.collect()
    blocks_before = sys.getallocatedblocks()
    async with accy.open_backend("cpu") as backend:
        fmt = choose_format(backend, document)
        pool = await accy.load_pipeline_artifacts(
            backend, document.pipeline, document.registry, fmt
        )
        lanes = [backend.create_stream() for _ in range(streams)]
        done = anyio.Event()

        async def heartbeat() -> None:
            while not done.is_set():
                before = time.perf_counter()
                await anyio.sleep(0.001)
                lags.append(time.perf_counter() - before - 0.001)

        async def caller(index: int) -> None:
            nonlocal wrong
            stream = lanes[index % streams]
            x = np.full(n, float(index % 7), np.float32)
            y = np.arange(n, dtype=np.float32)
            buffers = [accy.upload(backend, v, stream=stream) for v in (x, y)]
            out = backend.allocate_buffer(4 * n)
            try:
                for repeat in range(each):
                    a = float(repeat + 1)
                    await launch_pipeline(
                        backend,
                        PipelineLaunch(
                            pipeline=document.pipeline,
                            registry=document.registry,
                            format=fmt,
                            operands=[b.bind("read_only") for b in buffers],
                            results=[out.bind()],
                            runtime_scalar_arguments=(p.U32(n), p.F32(a)),
                            artifacts=pool,
                            stream=stream,
                        ),
                    )
                    got = await accy.download(backend, out, np.float32, n, stream=stream)
                    if not np.array_equal(got, a * x + y):
                        wrong += 1
            finally:
                await release_when_idle(backend, [*buffers, out], [stream])

        if tuned_gc:
            gc.freeze()
            gc.disable()
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            group.start_soon(heartbeat)
            async with anyio.create_task_group() as callers_group:
                for index in range(callers):
                    callers_group.start_soon(caller, index)
                    if index % 5 == 4:
                        await anyio.lowlevel.checkpoint()
            seconds = time.perf_counter() - started
            done.set()
        del caller, heartbeat
        cyclic_garbage = gc.collect()
        gc.enable()
        gc.unfreeze()
        await pool.aclose()
        backend.destroy_all(lanes)
        live_after = len(backend.live_objects())
    gc.collect()
    blocks_after = sys.getallocatedblocks()
    lags.sort()
    return LoadReport(
        callers=callers,
        pipelines_each=each,
        launches=callers * each,
        wrong=wrong,
        seconds=seconds,
        worst_lag_ms=lags[-1] * 1e3 if lags else 0.0,
        median_lag_ms=lags[len(lags) // 2] * 1e3 if lags else 0.0,
        blocks_before=blocks_before,
        blocks_after=blocks_after,
        live_after=live_after,
        tuned_gc=tuned_gc,
        cyclic_garbage=cyclic_garbage,
    )


# ----- the report ----------------------------------------------------------------------------


def _fuzz_counts(examples: int) -> dict[str, int]:
    from .test_fuzz import run_fuzz

    return run_fuzz(examples)


def _stateful_runs(examples: int) -> int:
    from .test_stateful import run_machine

    return run_machine(examples)


async def _async_figures(library_name: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    await load_test(50, 2)  # warm the library's bounded caches (plans, programs)
    figures["load"] = [await load_test(tuned_gc=True) for _ in range(3)]
    figures["load"].append(await load_test(tuned_gc=False))
    if library_name == "asyncio":
        figures["faults"] = await run_fault_sweeps()
    figures["cancellation"] = await run_cancellation_sweeps()
    return figures


def report(long: bool) -> str:
    started = time.perf_counter()
    asyncio_figures = anyio.run(_async_figures, "asyncio")
    trio_figures = anyio.run(_async_figures, "trio", backend="trio")
    fuzz = _fuzz_counts(10_000 if long else 500)
    stateful = _stateful_runs(1_000 if long else 100)
    faults: list[FaultReport] = asyncio_figures["faults"]
    cancels: list[CancellationReport] = [
        *asyncio_figures["cancellation"],
        *trio_figures["cancellation"],
    ]
    loads: list[tuple[str, LoadReport]] = [
        *(("asyncio", each) for each in asyncio_figures["load"]),
        *(("trio", each) for each in trio_figures["load"]),
    ]
    lines = [
        "# Reliability figures",
        "",
        "Regenerated by `make reliability` (`python -m tests.reliability --write"
        + (" --long" if long else "")
        + "`) on "
        + f"{time.strftime('%Y-%m-%d')}, {platform.system()} {platform.machine()}, "
        + f"{os.cpu_count()} cores, Python {platform.python_version()}; "
        + f"{time.perf_counter() - started:.0f} s. The GPU part is in "
        + "`benchmarks/results/` (sticky faults, memcheck).",
        "",
        "## Faults injected (recording backend)",
        "",
        "Every call of each kind below failed in turn (`accy_async.testing.fault_sweep`): the",
        "caller must get the injected error (or the library absorbs it where it documents a",
        "fallback), no device object may stay alive, and a clean run on the same backend must",
        "pass.",
        "",
        "| scenario | calls per kind (clean run) | points tried | raised | absorbed | problems |",
        "|---|---|---|---|---|---|",
    ]
    for fault in faults:
        calls = ", ".join(f"{k} {v}" for k, v in fault.calls.items() if v)
        lines.append(
            f"| {fault.scenario} | {calls} | {fault.points} | {fault.raised} | {fault.absorbed} | "
            f"{len(fault.problems)} |"
        )
    lines += [
        "",
        "## Cancellation (CPU backend, real worker threads)",
        "",
        "Cancelled after 0, 1, 2, ... checkpoints of another task until the work finished first",
        "(`accy_async.testing.cancellation_sweep`): after draining, nothing alive, no task left,",
        "the cancellation reached the caller, finished runs checksummed.",
        "",
        "| scenario | loop | how | points | cancelled | finished first | problems |",
        "|---|---|---|---|---|---|---|",
    ]
    loops = ["asyncio"] * len(asyncio_figures["cancellation"]) + ["trio"] * len(
        trio_figures["cancellation"]
    )
    for loop, cancel in zip(loops, cancels, strict=True):
        lines.append(
            f"| {cancel.scenario} | {loop} | {cancel.way} | {cancel.points} | {cancel.cancelled} | "
            f"{cancel.completed} | {len(cancel.problems)} |"
        )
    lines += [
        "",
        "## Fuzzed plans",
        "",
        "| what | cases |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in fuzz.items()),
        f"| stateful model runs (allocate, free, load, launch, cancel, fault) | {stateful} |",
        "",
        "Every rejection was a `PlanError` (or another documented `AccyError`) with a path;",
        "no other exception escaped; a rejected launch allocated nothing.",
        "",
        "## Load (CPU backend)",
        "",
        "1,000 callers, each running 10 saxpy pipelines (256 elements) and checking the result,",
        "on two streams; a 1 ms heartbeat beside them; three runs with the collector as the",
        "README recommends for latency-sensitive services (`gc.freeze()` after start-up, the",
        "cyclic collector paused for the burst), one with the defaults, whose collections walk",
        "the live state of the thousand callers and pause the loop for tens of ms. Target: worst",
        "lag under 10 ms. Cycles found is what a full collection right after the burst",
        "collected: with the collector paused, every reference cycle the 10,000 launches made",
        "(the library's launch and wait paths make none, so pausing the collector leaks",
        "nothing). Python's",
        "allocated blocks are counted before the backend opens and after it closes; the few",
        "thousand more after are anyio's idle worker threads and the library's bounded caches",
        "(a second run starts within 0.1% of where the first ended).",
        "",
        "| loop | GC | launches | wrong results | seconds | heartbeat worst lag | median lag | "
        "cycles found | Python blocks before / after | objects alive after |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {loop} | {'frozen, paused for the burst' if load.tuned_gc else 'default'} | "
            f"{load.launches} | {load.wrong} | {load.seconds:.1f} | {load.worst_lag_ms:.1f} ms | "
            f"{load.median_lag_ms:.2f} ms | {load.cyclic_garbage} | "
            f"{load.blocks_before:,} / {load.blocks_after:,} | {load.live_after} |"
            for loop, load in loads
        ),
        "",
        "## On the GPU",
        "",
        "`benchmarks/results/gpu-tests.log`: `test_an_out_of_bounds_kernel_is_a_device_fault_"
        "without_a_hang` (`tests/test_cuda.py`) plants an illegal address while two streams,",
        "a read and",
        "50 events are awaited: all 53 waiters fail with `DeviceFault`, and allocate, create",
        "stream, create event, launch and record are each refused at once. `memcheck-pytest.txt`:",
        "123 GPU tests (the library, graphs, kernels, pipelines, tuning, the backend contract,",
        "the compile pool, waiting, and `test_cuda.py` but its 10,000-waiter and 10^8-element",
        "tests) under `compute-sanitizer --tool memcheck`: 0 errors.",
        "",
        "## Untrusted plans",
        "",
        "`tests/test_reliability.py::test_untrusted_*`: a plan naming an unregistered CPU kernel",
        "(`os.system`, a module path) is refused at create time; an intermediate of 2**60 bytes",
        "and one over a configured `Limits` are refused before any allocation; runtime scalars",
        "outside their bounds are refused before any allocation.",
    ]
    problems = [f"- {f.scenario}: {pr.point}: {pr.problem}" for f in faults for pr in f.problems]
    problems += [
        f"- {c.scenario} ({c.way}): {pr.point}: {pr.problem}" for c in cancels for pr in c.problems
    ]
    if problems:
        lines += ["", "## Problems found", "", *problems[:50]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="regenerate docs/reliability.md")
    parser.add_argument("--write", action="store_true", help="rewrite docs/reliability.md")
    parser.add_argument("--long", action="store_true", help="10,000 fuzz cases, 1,000 models")
    args = parser.parse_args(argv)
    text = report(args.long)
    print(text)
    if args.write:
        target = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
        target.parent.mkdir(exist_ok=True)
        target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
