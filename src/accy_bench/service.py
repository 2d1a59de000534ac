"""The scan service: tasks on one loop serving prefix sums, beside CuPy through worker threads.

1 or 64 tasks each launch the built-in ``prefix_sum_i32`` pipeline on their own
stream and read the last element back (it must equal ``n``), for small requests
(throughput) and varied ones (latency over five decades of sizes).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import random
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread
import numpy as np

from accy_async import (
    U32,
    U64,
    ArtifactFormat,
    PipelineLaunch,
    allocate_pipeline_intermediates,
    choose_format,
    download,
    launch_pipeline,
    load_pipeline_artifacts,
    wait_stream,
)
from accy_async.library import load_builtin

from .latency import Heartbeat
from .rig import Rig, driver, run_on
from .stamps import ONE, MappedStamps, load_spin_stamp
from .stats import SEED, ClockLine, GcPauses, Samples, Section, guarded, log_uniform, merge

if TYPE_CHECKING:
    from accy_async import (
        BufferBinding,
        BufferHandle,
        LoadedArtifact,
        PipelineArtifactPool,
        PipelineDocument,
        PipelineIntermediates,
        StreamHandle,
    )
    from accy_async.backends import DeviceObject
    from accy_async.backends.cuda import CudaBackend

__all__ = [
    "CUPY_NOTE",
    "ServiceWorkload",
    "accy_service_rows",
    "optional_cupy",
    "request_plan",
    "service_max_n",
    "service_section",
    "service_workloads",
    "short_number",
]

_CALIBRATIONS: Final = 20
"""Calibration launches before and after each service row."""
_MEMORY_BUDGET: Final = 100 * 10**9
"""Bytes the service's buffers may take on the device."""


@dataclass(frozen=True, slots=True)
class ServiceWorkload:
    """Prefix-sum requests of ``n`` log-uniform from ``low`` to ``high``, ``requests`` a row."""

    name: str
    low: int
    high: int
    requests: int


def short_number(value: int) -> str:
    """``1000`` as ``1e3``, ``300000000`` as ``3e8``."""
    exponent = math.floor(math.log10(value))
    return f"{value / 10**exponent:g}e{exponent}"


def service_workloads(
    small: tuple[int, int], varied: tuple[int, int], *, quick: bool = False
) -> tuple[ServiceWorkload, ServiceWorkload]:
    """Small requests (throughput) and varied ones (latency over five decades of sizes)."""
    scale = 5 if quick else 1
    return (
        ServiceWorkload(
            f"small: n log-uniform {short_number(small[0])}..{short_number(small[1])}",
            *small,
            2000 // scale,
        ),
        ServiceWorkload(
            f"varied: n log-uniform {short_number(varied[0])}..{short_number(varied[1])}",
            *varied,
            400 // scale,
        ),
    )


def service_max_n(high: int, tasks: int, budget: int = _MEMORY_BUDGET) -> int:
    """The largest ``n`` at which ``tasks`` outputs and the shared input fit in ``budget``."""
    return min(high, budget // (4 * (tasks + 1)))


def request_plan(workload: ServiceWorkload, tasks: int, high: int) -> list[list[int]]:
    """Each task's request sizes, seeded by workload, task count and task."""
    per_task = max(workload.requests // tasks, 1)
    plan = []
    for index in range(tasks):
        rng = random.Random(f"{SEED}/{workload.name}/{tasks}/{index}")
        plan.append([log_uniform(rng, workload.low, high) for _ in range(per_task)])
    return plan


@dataclass(frozen=True, slots=True)
class _Lane:
    """One task's own stream, scratch, output buffer and stamp word."""

    stream: StreamHandle
    scratch: PipelineIntermediates
    y: BufferHandle
    stamp_binding: BufferBinding
    stamp: ctypes.c_uint64


@dataclass(frozen=True, slots=True)
class _ScanService:
    """The shared pool, input (all ones) and stamp kernel, and a lane per task."""

    backend: CudaBackend
    document: PipelineDocument
    format: ArtifactFormat
    pool: PipelineArtifactPool
    x: BufferHandle
    stamper: LoadedArtifact
    lanes: list[_Lane]

    async def request(self, lane: _Lane, n: int) -> tuple[int, int, bool]:
        """Scan ``n`` ones, stamp, read the last element: (resumed ns, stamp ns, it was ``n``)."""
        backend = self.backend
        lane.stamp.value = 0
        await launch_pipeline(
            backend,
            PipelineLaunch(
                pipeline=self.document.pipeline,
                registry=self.document.registry,
                format=self.format,
                operands=[self.x.bind("read_only", byte_size=4 * n)],
                results=[lane.y.bind(byte_size=4 * n)],
                runtime_scalar_arguments=(U32(n),),
                intermediates=lane.scratch,
                artifacts=self.pool,
                stream=lane.stream,
            ),
        )
        backend.launch(self.stamper, [lane.stamp_binding], [U64(0)], ONE, stream=lane.stream)
        last = await download(backend, lane.y, np.int32, 1, offset=4 * (n - 1), stream=lane.stream)
        resumed = time.time_ns()
        return resumed, lane.stamp.value, int(last[0]) == n


async def _open_scan_service(
    stack: contextlib.AsyncExitStack, lanes: int, max_n: int
) -> _ScanService:
    """Set the service up; ``stack`` releases everything, in order, when it closes."""
    from accy_async.backends.cuda import CudaBackend

    stamps = MappedStamps(lanes)
    stack.callback(stamps.close)
    backend = CudaBackend()
    stack.push_async_callback(backend.aclose)
    objects: list[DeviceObject] = []
    # The stack unwinds in reverse: these are destroyed after the pool and the scratch buffers
    # have waited for the lanes' streams. What is made below joins the list.
    stack.callback(backend.destroy_all, objects)
    document = load_builtin("prefix_sum_i32")
    fmt = choose_format(backend, document)
    pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry, fmt)
    stack.push_async_callback(pool.aclose)
    x = backend.allocate_buffer(4 * max_n)
    objects.append(x)
    backend.fill_buffer(x, 1)
    stamper = await load_spin_stamp(backend)
    handle = backend.register_external_buffer(stamps.native, stamps.byte_size)
    objects += [stamper, handle]
    made = []
    for index in range(lanes):
        scratch = await allocate_pipeline_intermediates(backend, document.pipeline, (U32(max_n),))
        stack.push_async_callback(scratch.aclose)
        stream, y = backend.create_stream(), backend.allocate_buffer(4 * max_n)
        objects += [stream, y]
        binding = handle.bind(offset=8 * index, byte_size=8)
        made.append(_Lane(stream, scratch, y, binding, stamps.slot(index)))
    await wait_stream(backend)  # the fill
    return _ScanService(backend, document, fmt, pool, x, stamper, made)


async def _drive(
    sizes: Sequence[Sequence[int]],
    serve: Callable[[int, Sequence[int]], Coroutine[Any, Any, None]],
) -> tuple[float, float, float, GcPauses]:
    """Run one task per lane beside a heartbeat: (process CPU s, wall s, worst lag s, GC)."""
    heartbeat = Heartbeat()
    with GcPauses() as pauses:
        async with anyio.create_task_group() as outer:
            outer.start_soon(heartbeat.run)
            cpu, wall = time.process_time(), time.perf_counter()
            async with anyio.create_task_group() as group:
                for index, lane_sizes in enumerate(sizes):
                    group.start_soon(serve, index, lane_sizes)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            outer.cancel_scope.cancel()
    return cpu, wall, heartbeat.worst, pauses


def _warm_up_sizes(workload: ServiceWorkload, tasks: int, high: int) -> list[list[int]]:
    """One small request a task, and one of the largest size for the first."""
    return [[workload.low, high], *([[workload.low]] * (tasks - 1))]


def _calibration(rig: Rig) -> tuple[int, int]:
    offset = rig.calibrate(_CALIBRATIONS)
    return time.time_ns(), offset


async def _accy_service_row(
    rig: Rig, service: _ScanService, sizes: list[list[int]], warm_up: list[list[int]]
) -> dict[str, Any]:
    outcomes: list[tuple[int, int, bool]] = []

    async def serve(index: int, lane_sizes: Sequence[int]) -> None:
        lane = service.lanes[index]
        outcomes.extend([await service.request(lane, n) for n in lane_sizes])

    await _drive(warm_up, serve)
    outcomes.clear()
    before = _calibration(rig)
    cpu, wall, lag, pauses = await _drive(sizes, serve)
    line = ClockLine(*before, *_calibration(rig))
    samples = Samples(cpu_s=cpu, wall_s=wall)
    for resumed, stamp, right in outcomes:
        latency = line.latency_us(resumed, stamp) if stamp else None
        samples.add(latency, wrong=not (right and stamp))
    return samples.service_summary(lag, pauses)


def _tasks_label(tasks: int) -> str:
    return f"{tasks} task" if tasks == 1 else f"{tasks} tasks"


async def accy_service_rows(
    rig: Rig,
    library: str,
    workloads: Sequence[ServiceWorkload],
    tasks: Sequence[int],
    max_n: int,
) -> Section:
    """accy-async's rows of each workload and task count, on the running loop's library."""
    driver().cuCtxSetCurrent(rig.context)
    section: Section = {}
    async with contextlib.AsyncExitStack() as stack:
        service = await _open_scan_service(stack, max(tasks), max_n)
        gc.collect()
        gc.freeze()  # the service's start-up state, as a long-running service would
        for workload in workloads:
            high = min(workload.high, max_n)
            for count in tasks:
                name = f"accy launch_pipeline + download, {_tasks_label(count)} ({library})"
                section.setdefault(workload.name, {})[name] = await _accy_service_row(
                    rig,
                    service,
                    request_plan(workload, count, high),
                    _warm_up_sizes(workload, count, high),
                )
    return section


def _cupy_scan(cupy: Any, x: Any, n: int, stream: Any) -> int:
    """In a worker thread: the inclusive scan of ``x[:n]``, its last element once done."""
    with stream:
        y = cupy.cumsum(x[:n], dtype=cupy.int32)
        stream.synchronize()
        return int(y[n - 1])


CUPY_NOTE: Final = (
    "latency from submit to resume (no device stamp); anyio's default 40 worker threads"
)


async def _cupy_service_row(
    cupy: Any, x: Any, streams: list[Any], sizes: list[list[int]], warm_up: list[list[int]]
) -> dict[str, Any]:
    outcomes: list[tuple[float, bool]] = []

    async def serve(index: int, lane_sizes: Sequence[int]) -> None:
        stream = streams[index]
        for n in lane_sizes:
            submitted = time.perf_counter()
            last = await anyio.to_thread.run_sync(_cupy_scan, cupy, x, n, stream)
            outcomes.append(((time.perf_counter() - submitted) * 1e6, last == n))

    await _drive(warm_up, serve)
    outcomes.clear()
    cpu, wall, lag, pauses = await _drive(sizes, serve)
    samples = Samples(cpu_s=cpu, wall_s=wall)
    for latency, right in outcomes:
        samples.add(latency, wrong=not right)
    row = samples.service_summary(lag, pauses)
    row["note"] = CUPY_NOTE
    return row


async def _cupy_service_rows(
    cupy: Any, workloads: Sequence[ServiceWorkload], tasks: Sequence[int], max_n: int
) -> Section:
    section: Section = {}
    x = cupy.ones(max_n, dtype=cupy.int32)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(tasks))]
    try:
        for workload in workloads:
            high = min(workload.high, max_n)
            for count in tasks:
                name = f"CuPy cumsum via to_thread, {_tasks_label(count)} (asyncio)"
                section.setdefault(workload.name, {})[name] = await _cupy_service_row(
                    cupy,
                    x,
                    streams,
                    request_plan(workload, count, high),
                    _warm_up_sizes(workload, count, high),
                )
    finally:
        del x
        cupy.get_default_memory_pool().free_all_blocks()
    return section


def optional_cupy() -> tuple[Any, str]:
    """CuPy, or ``None`` and why it cannot be used."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - a missing baseline is reported
        return None, f"unavailable: {type(exc).__name__}: {exc}"
    return cupy, ""


def service_section(
    rig: Rig,
    libraries: Sequence[str],
    workloads: Sequence[ServiceWorkload],
    tasks: Sequence[int],
    cupy: tuple[Any, str],
) -> Section:
    """The accy-async rows on each library, then CuPy's on asyncio."""
    max_n = max(service_max_n(workload.high, max(tasks)) for workload in workloads)
    section: Section = {workload.name: {} for workload in workloads}
    for library in libraries:
        print(f"service on {library}", file=sys.stderr, flush=True)
        names = [f"accy launch_pipeline + download, {_tasks_label(c)} ({library})" for c in tasks]
        measure = partial(accy_service_rows, rig, library, workloads, tasks, max_n)
        shape = {workload.name: names for workload in workloads}
        merge(section, run_on(library, guarded, shape, measure))
    names = [f"CuPy cumsum via to_thread, {_tasks_label(c)} (asyncio)" for c in tasks]
    shape = {workload.name: names for workload in workloads}
    module, unavailable = cupy
    if module is None:
        merge(
            section,
            {workload: dict.fromkeys(rows, unavailable) for workload, rows in shape.items()},
        )
    else:
        print("service: CuPy on asyncio", file=sys.stderr, flush=True)
        measure = partial(_cupy_service_rows, module, workloads, tasks, max_n)
        merge(section, run_on("asyncio", guarded, shape, measure))
    return section
