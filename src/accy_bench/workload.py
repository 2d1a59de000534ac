"""Application workloads on the GPU: accy-async beside its baselines, in one run.

``python -m accy_bench.workload --out DIR`` writes ``workload.json`` and
``workload.md``. Two sections:

* **completion**: microseconds from a kernel's end (its last ``%globaltimer``
  reading, written to host-mapped memory) until the awaiting task runs, for
  kernels whose lengths are fixed, random, bimodal, queued eight deep, or
  launched on a stream created for the trial. accy-async's waits (each wait
  policy, ``wait_stream``, and the completion reactor alone) beside polling
  from the loop and ``to_thread(cuEventSynchronize)``;
* **service**: a prefix-sum service. 1 or 64 tasks on one loop each launch the
  built-in ``prefix_sum_i32`` pipeline on their own stream and read the last
  element back (it must equal ``n``); beside CuPy's ``cumsum`` in worker
  threads.

Every row runs on asyncio, uvloop and trio, with the worst lag of a 1 ms
heartbeat on the same loop and the process CPU time (every thread) per second
of waiting. Random lengths and sizes come from seeded generators, so every
method sees the same sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from accy_async import (
    U32,
    U64,
    ArtifactFormat,
    ArtifactSpec,
    PipelineLaunch,
    allocate_pipeline_intermediates,
    choose_format,
    download,
    launch_pipeline,
    load_pipeline_artifacts,
    wait_event,
    wait_stream,
)
from accy_async.library import load_builtin
from accy_async.plan import TextPayload
from accy_async.waiting import sleep_until

from .latency import Heartbeat
from .provenance import describe_run, git_revision
from .rig import Rig, driver, ok, run_on

if TYPE_CHECKING:
    from accy_async import (
        Backend,
        BufferBinding,
        BufferHandle,
        EventHandle,
        LoadedArtifact,
        PipelineArtifactPool,
        PipelineDocument,
        PipelineIntermediates,
        StreamHandle,
    )
    from accy_async.backends import DeviceObject
    from accy_async.backends.cuda import CudaBackend

__all__ = [
    "ACCY_METHODS",
    "BASELINES",
    "COMPLETION_COLUMNS",
    "COMPLETION_WORKLOADS",
    "CUPY_NOTE",
    "LIBRARIES",
    "SECTIONS",
    "SERVICE_COLUMNS",
    "AccyMethod",
    "ClockLine",
    "CompletionWorkload",
    "MappedStamps",
    "Samples",
    "ServiceWorkload",
    "completion_seconds",
    "failure",
    "git_revision",
    "log_uniform",
    "main",
    "markdown",
    "parse_args",
    "parse_size_range",
    "percentile",
    "quick_workloads",
    "request_plan",
    "run_workload",
    "service_max_n",
    "service_workloads",
    "short_number",
    "sort_rows",
    "table",
    "trial_lengths",
]

Policy: TypeAlias = Literal["latency", "balanced", "frugal"]
Waiter: TypeAlias = Callable[[Any], Awaitable[None]]
"""Waits, from the loop, for the work enqueued on a stream (a native stream or a handle)."""
Section: TypeAlias = dict[str, dict[str, Any]]
"""Workload name -> row name -> the row (a dict), or why it is missing (a string)."""
T = TypeVar("T")

LIBRARIES: Final = ("asyncio", "uvloop", "trio")
SECTIONS: Final = ("completion", "service", "cancellation")
_SEED: Final = 20261201

_SPIN_STAMP: Final = r"""
extern "C" __global__ void spin_stamp(volatile unsigned long long* stamp,
                                       unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *stamp = now;
    __threadfence_system();
}
"""
"""The rig's ``spin_then_stamp`` with the buffer first, as accy-async launches take them."""

_SPIN_STAMP_HIDDEN: Final = r"""
extern "C" __global__ void spin_stamp_hidden(volatile unsigned long long* stamp,
                                              const unsigned long long* length,
                                              unsigned long long unused) {
    unsigned long long start, now, ns = length[0];
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *stamp = now;
    __threadfence_system();
}
"""
"""``spin_stamp`` whose length comes from device memory: nothing in the launch predicts it."""

_ONE: Final = (1, 1, 1)
_GAP_S: Final = 0.5e-3
"""The pause between trials, slept on the loop's precise clock."""
_POLL_S: Final = 120e-6
"""The period of the loop-local polling baseline."""
_TRIAL_OVERHEAD_S: Final = 0.65e-3
"""A trial's time beyond its kernels: the gap, two calibrations, launch and wake-up."""
_CALIBRATIONS: Final = 20
"""Calibration launches before and after each service row."""
_MEMORY_BUDGET: Final = 100 * 10**9
"""Bytes the service's buffers may take on the device."""


# ----- statistics ----------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value with ``fraction`` of them at or below it."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(math.ceil(fraction * len(ordered)), 1)
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class Samples:
    """What one row gathers: latencies, CPU and wall time, and the waits that went wrong."""

    latencies_us: list[float] = field(default_factory=list)
    count: int = 0
    wrong: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0

    def add(
        self,
        latency_us: float | None,
        *,
        wrong: bool = False,
        cpu_s: float = 0.0,
        wall_s: float = 0.0,
    ) -> None:
        """Count one wait; a wait without a latency (its stamp never landed) is only counted."""
        self.count += 1
        if latency_us is not None:
            self.latencies_us.append(latency_us)
        self.wrong += wrong
        self.cpu_s += cpu_s
        self.wall_s += wall_s

    def summary(self, worst_lag_s: float, pauses: _GcPauses | None = None) -> dict[str, Any]:
        """The row: latency percentiles, CPU cores and per wait, heartbeat lag, wrong count.

        With ``pauses``, the garbage collector's pauses meanwhile (what else stalls a loop).
        """
        latencies = self.latencies_us
        return {
            "gc_pauses": None if pauses is None else pauses.count,
            "worst_gc_pause_ms": None if pauses is None else pauses.worst * 1e3,
            "count": self.count,
            "median_us": statistics.median(latencies) if latencies else None,
            "p90_us": percentile(latencies, 0.90) if latencies else None,
            "p99_us": percentile(latencies, 0.99) if latencies else None,
            "cpu_cores": self.cpu_s / self.wall_s if self.wall_s else None,
            "cpu_us_per_wait": self.cpu_s / self.count * 1e6 if self.count else None,
            "worst_heartbeat_lag_ms": worst_lag_s * 1e3,
            "wrong": self.wrong,
        }

    def service_summary(
        self, worst_lag_s: float, pauses: _GcPauses | None = None
    ) -> dict[str, Any]:
        """:meth:`summary` with the requests per second of wall time."""
        row = self.summary(worst_lag_s, pauses)
        row["requests_per_s"] = self.count / self.wall_s if self.wall_s else None
        return row


class _GcPauses:
    """Within ``with``: how often Python's garbage collector ran, and its longest pause."""

    def __init__(self) -> None:
        self.count = 0
        self.worst = 0.0
        self._started = 0.0

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        del info
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.worst = max(self.worst, time.perf_counter() - self._started)

    def __enter__(self) -> _GcPauses:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._observe)


@dataclass(frozen=True, slots=True)
class ClockLine:
    """The host-minus-GPU clock offset, calibrated at two host instants and interpolated.

    The service calibrates only while the device is idle, before and after a
    row: a calibration among 64 busy streams would queue behind their kernels
    and block the loop while the host spins for its stamp.
    """

    start_ns: int
    start_offset: int
    end_ns: int
    end_offset: int

    def offset_at(self, host_ns: int) -> float:
        """The offset at ``host_ns`` (a ``time.time_ns()``), on the line through the two."""
        if self.end_ns == self.start_ns:
            return float(self.start_offset)
        fraction = (host_ns - self.start_ns) / (self.end_ns - self.start_ns)
        return self.start_offset + fraction * (self.end_offset - self.start_offset)

    def latency_us(self, resumed_ns: int, stamp_ns: int) -> float:
        """Microseconds from a device stamp to a host resumption."""
        return (resumed_ns - stamp_ns - self.offset_at(resumed_ns)) / 1e3


def failure(exc: BaseException) -> str:
    """A row's text for a measurement that raised (the first leaf of an exception group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"failed: {type(exc).__name__}: {exc}"


# ----- workloads -----------------------------------------------------------------------------


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer from ``low`` to ``high`` whose logarithm is uniform."""
    return min(max(round(math.exp(rng.uniform(math.log(low), math.log(high)))), low), high)


def _fixed(ns: int, rng: random.Random) -> tuple[int, ...]:
    del rng
    return (ns,)


def _log_uniform_lengths(low: int, high: int, count: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(log_uniform(rng, low, high) for _ in range(count))


def _bimodal(short: int, long: int, rng: random.Random) -> tuple[int, ...]:
    return (rng.choice((short, long)),)


@dataclass(frozen=True, slots=True)
class CompletionWorkload:
    """Kernels to wait for: ``draw`` gives one trial's kernel lengths in nanoseconds."""

    name: str
    trials: int
    draw: Callable[[random.Random], tuple[int, ...]]
    fresh_stream: bool = False
    """Create a stream for each trial and destroy it after."""
    hidden_length: bool = False
    """accy-async's kernels read their length from device memory (written before each
    launch), so no launch argument predicts it; the baselines' kernels are the usual ones."""


# Mean kernel time per trial: 0.1, 2, 1.0, 1.6, 8 x 0.32 and 1.2 ms. With ~0.65 ms more a
# trial (the gap, calibration, launch), one method on one loop takes ~1.2 s; the 5 accy-async
# methods and 3 baselines on asyncio, uvloop and trio ~28 s (`completion_seconds`), ~6 s with
# --quick. The fixed 100 us row gets the most trials: a wait's own costs show most in its tail.
COMPLETION_WORKLOADS: Final = (
    CompletionWorkload("fixed 100 us", 200, partial(_fixed, 100_000)),
    CompletionWorkload("fixed 2 ms", 60, partial(_fixed, 2_000_000)),
    CompletionWorkload(
        "log-uniform 50 us-5 ms", 150, partial(_log_uniform_lengths, 50_000, 5_000_000, 1)
    ),
    CompletionWorkload("bimodal 100 us / 3 ms", 60, partial(_bimodal, 100_000, 3_000_000)),
    CompletionWorkload(
        "queued: 8 back-to-back on one stream",
        60,
        partial(_log_uniform_lengths, 50_000, 1_000_000, 8),
    ),
    CompletionWorkload(
        "first wait on a fresh stream",
        150,
        partial(_log_uniform_lengths, 50_000, 5_000_000, 1),
        fresh_stream=True,
    ),
    CompletionWorkload(
        "log-uniform 50 us-5 ms, length not in the launch",
        150,
        partial(_log_uniform_lengths, 50_000, 5_000_000, 1),
        hidden_length=True,
    ),
)


def quick_workloads(workloads: Sequence[CompletionWorkload]) -> tuple[CompletionWorkload, ...]:
    """The same workloads with a fifth of the trials (at least 10), for smoke runs."""
    return tuple(replace(w, trials=max(w.trials // 5, 10)) for w in workloads)


def trial_lengths(workload: CompletionWorkload) -> list[tuple[int, ...]]:
    """Each trial's kernel lengths, a warm-up trial first; the same for every method."""
    rng = random.Random(f"{_SEED}/{workload.name}")
    return [workload.draw(rng) for _ in range(workload.trials + 1)]


def completion_seconds(workloads: Sequence[CompletionWorkload], loops: int) -> float:
    """About how long the completion section runs on ``loops`` event loop libraries."""
    per_method = sum(
        sum(lengths) * 1e-9 + _TRIAL_OVERHEAD_S
        for workload in workloads
        for lengths in trial_lengths(workload)
    )
    return per_method * (len(ACCY_METHODS) + len(BASELINES)) * loops


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
        rng = random.Random(f"{_SEED}/{workload.name}/{tasks}/{index}")
        plan.append([log_uniform(rng, workload.low, high) for _ in range(per_task)])
    return plan


# ----- the device side -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Mapped:
    """The ``native`` of an external buffer: where the device sees mapped host memory."""

    address: int


class MappedStamps:
    """Pinned host words the device writes its stamps to, each seen at once by the host."""

    def __init__(self, count: int) -> None:
        d = driver()
        flags = int(d.CU_MEMHOSTALLOC_DEVICEMAP) | int(d.CU_MEMHOSTALLOC_PORTABLE)
        self.byte_size = 8 * count
        self.host = int(ok(d.cuMemHostAlloc(self.byte_size, flags), "host alloc"))
        device = int(ok(d.cuMemHostGetDevicePointer(self.host, 0), "device pointer"))
        self.native = _Mapped(device)
        ctypes.memset(self.host, 0, self.byte_size)

    def slot(self, index: int) -> ctypes.c_uint64:
        """Stamp ``index``, read and cleared by the host."""
        return ctypes.c_uint64.from_address(self.host + 8 * index)

    def close(self) -> None:
        """Free the memory (after every backend that registered it has closed)."""
        ok(driver().cuMemFreeHost(self.host), "free host")


async def _load_spin_stamp(backend: Backend, *, hidden: bool = False) -> LoadedArtifact:
    spec = ArtifactSpec(
        kernel_name="spin_stamp_hidden" if hidden else "spin_stamp",
        format=ArtifactFormat.CUDA_SOURCE,
        payload=TextPayload(_SPIN_STAMP_HIDDEN if hidden else _SPIN_STAMP),
        argument_count=3 if hidden else 2,
        scalar_argument_count=1,
    )
    return await backend.load_artifact(await backend.create_artifact(spec))


async def _guarded(
    shape: dict[str, list[str]], measure: Callable[[], Awaitable[Section]]
) -> Section:
    """``measure()``, or its rows (``shape``: workload -> row names) saying why it failed."""
    try:
        return await measure()
    except Exception as exc:  # noqa: BLE001 - a method that fails is reported, the rest run
        return {workload: dict.fromkeys(names, failure(exc)) for workload, names in shape.items()}


def _merge(into: Section, part: Section) -> None:
    for workload, rows in part.items():
        into.setdefault(workload, {}).update(rows)


# ----- completion ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AccyMethod:
    """One way accy-async waits: on an event or the stream, with a policy, with a reactor."""

    label: str
    on: Literal["event", "stream"]
    policy: Policy | None = None
    anticipation: bool = True


ACCY_METHODS: Final = (
    AccyMethod("accy wait_event, balanced (default)", "event"),
    AccyMethod("accy wait_stream, balanced", "stream"),
    AccyMethod("accy wait_event, policy latency", "event", "latency"),
    AccyMethod("accy wait_event, policy frugal", "event", "frugal"),
    AccyMethod("accy wait_event, reactor only", "event", anticipation=False),
)


async def _poll_yield(event: Any, stream: Any) -> None:
    d = driver()
    ok(d.cuEventRecord(event, stream), "record")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY
    while d.cuEventQuery(event)[0] == not_ready:
        await anyio.lowlevel.checkpoint()


async def _poll_timer(event: Any, stream: Any) -> None:
    d = driver()
    ok(d.cuEventRecord(event, stream), "record")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY
    while d.cuEventQuery(event)[0] == not_ready:
        await sleep_until(time.perf_counter() + _POLL_S)


async def _to_thread(event: Any, stream: Any) -> None:
    d = driver()
    ok(d.cuEventRecord(event, stream), "record")
    ok(await anyio.to_thread.run_sync(d.cuEventSynchronize, event), "synchronize")


BASELINES: Final[dict[str, Callable[[Any, Any], Awaitable[None]]]] = {
    "poll cuEventQuery + yield (the floor, burns a core)": _poll_yield,
    "poll cuEventQuery every 120 us on the loop's clock": _poll_timer,
    "to_thread(cuEventSynchronize)": _to_thread,
}
"""The baselines: raw rig kernels and a raw event on the rig's stream."""


@dataclass(frozen=True, slots=True)
class _Target:
    """Where a method's kernels run and stamp: a stream, a stamp word, how to launch."""

    stream: Any
    stamp: ctypes.c_uint64
    launch: Callable[[int, Any], None]
    """Enqueue a kernel of ``ns`` nanoseconds on a stream."""
    open_stream: Callable[[], Any]
    close_stream: Callable[[Any], object]


def _raw_target(rig: Rig) -> _Target:
    d = driver()

    def open_stream() -> Any:
        return ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")

    return _Target(rig.stream, rig.stamp, rig.launch_spin, open_stream, d.cuStreamDestroy)


def _accy_target(
    backend: CudaBackend,
    loaded: LoadedArtifact,
    binding: BufferBinding,
    stamp: ctypes.c_uint64,
    stream: StreamHandle,
    hidden: tuple[LoadedArtifact, BufferHandle] | None = None,
) -> _Target:
    buffers = [binding]

    def launch(ns: int, on: StreamHandle) -> None:
        # Through the backend, so it learns the kernel's cost from the scalar.
        backend.launch(loaded, buffers, [U64(ns)], _ONE, _ONE, stream=on)

    def launch_hidden(ns: int, on: StreamHandle) -> None:
        # The length goes to device memory first: the launch's arguments never change.
        assert hidden is not None
        kernel, length = hidden
        backend.write_buffer(length, ns.to_bytes(8, "little"), stream=on)
        backend.launch(kernel, [binding, length.bind("read_only")], [U64(0)], _ONE, _ONE, stream=on)

    return _Target(
        stream,
        stamp,
        launch if hidden is None else launch_hidden,
        backend.create_stream,
        backend.destroy,
    )


def _accy_waiter(backend: CudaBackend, event: EventHandle, method: AccyMethod) -> Waiter:
    policy = method.policy
    if method.on == "stream":

        async def on_stream(stream: StreamHandle) -> None:
            await wait_stream(backend, stream, policy=policy)

        return on_stream

    async def on_event(stream: StreamHandle) -> None:
        backend.record_event(event, stream)
        await wait_event(backend, event, policy=policy)

    return on_event


async def _completion_row(
    rig: Rig,
    target: _Target,
    wait: Waiter,
    trials: Sequence[tuple[int, ...]],
    fresh_stream: bool,
) -> dict[str, Any]:
    """Launch each trial's kernels, wait, and measure from the last kernel's stamp to resuming."""
    heartbeat = Heartbeat()
    samples = Samples()
    with _GcPauses() as pauses:
        await _trials(rig, target, wait, trials, fresh_stream, heartbeat, samples)
    return samples.summary(heartbeat.worst, pauses)


async def _trials(
    rig: Rig,
    target: _Target,
    wait: Waiter,
    trials: Sequence[tuple[int, ...]],
    fresh_stream: bool,
    heartbeat: Heartbeat,
    samples: Samples,
) -> None:
    async with anyio.create_task_group() as group:
        group.start_soon(heartbeat.run)
        for index, lengths in enumerate(trials):
            rig.calibrate(2)  # the GPU and host clocks drift apart: relate them per trial
            stream = target.open_stream() if fresh_stream else target.stream
            target.stamp.value = 0
            cpu, wall = time.process_time(), time.perf_counter()
            for ns in lengths:
                target.launch(ns, stream)
            await wait(stream)
            resumed = time.time_ns()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            stamp = target.stamp.value  # the last kernel's: they all stamp the same word
            if fresh_stream:
                target.close_stream(stream)
            if index:
                latency = (resumed - stamp - rig.clock_offset) / 1e3 if stamp else None
                samples.add(latency, wrong=not stamp, cpu_s=cpu, wall_s=wall)
            else:  # the warm-up trial: thread pools, first launches, caches
                heartbeat.worst = 0.0
            await sleep_until(time.perf_counter() + _GAP_S)
        group.cancel_scope.cancel()


async def _accy_completion(
    rig: Rig,
    row: str,
    method: AccyMethod,
    workloads: Sequence[CompletionWorkload],
    draws: dict[str, list[tuple[int, ...]]],
) -> Section:
    from accy_async.backends.cuda import CudaBackend

    rows: Section = {}
    async with contextlib.AsyncExitStack() as stack:
        stamps = MappedStamps(1)
        stack.callback(stamps.close)
        backend = CudaBackend(anticipation=method.anticipation)
        stack.push_async_callback(backend.aclose)
        loaded = await _load_spin_stamp(backend)
        hidden = (await _load_spin_stamp(backend, hidden=True), backend.allocate_buffer(8))
        handle = backend.register_external_buffer(stamps.native, stamps.byte_size)
        stream, event = backend.create_stream(), backend.create_event()
        wait = _accy_waiter(backend, event, method)
        for workload in workloads:
            target = _accy_target(
                backend,
                loaded,
                handle.bind(),
                stamps.slot(0),
                stream,
                hidden if workload.hidden_length else None,
            )
            rows[workload.name] = {
                row: await _completion_row(
                    rig, target, wait, draws[workload.name], workload.fresh_stream
                )
            }
        await wait_stream(backend, stream)
        backend.destroy_all([handle, event, stream, loaded, *hidden])
    return rows


async def _baseline_completion(
    rig: Rig,
    row: str,
    label: str,
    workloads: Sequence[CompletionWorkload],
    draws: dict[str, list[tuple[int, ...]]],
) -> Section:
    d = driver()
    event = ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "event")
    try:
        target = _raw_target(rig)
        wait = partial(BASELINES[label], event)
        return {
            workload.name: {
                row: await _completion_row(
                    rig, target, wait, draws[workload.name], workload.fresh_stream
                )
            }
            for workload in workloads
        }
    finally:
        d.cuEventDestroy(event)


async def _completion_rows(
    rig: Rig,
    library: str,
    workloads: Sequence[CompletionWorkload],
    draws: dict[str, list[tuple[int, ...]]],
) -> Section:
    driver().cuCtxSetCurrent(rig.context)
    section: Section = {}
    for method in ACCY_METHODS:
        row = f"{method.label} ({library})"
        measure = partial(_accy_completion, rig, row, method, workloads, draws)
        _merge(section, await _guarded({w.name: [row] for w in workloads}, measure))
    for label in BASELINES:
        row = f"{label} ({library})"
        measure = partial(_baseline_completion, rig, row, label, workloads, draws)
        _merge(section, await _guarded({w.name: [row] for w in workloads}, measure))
    return section


def _completion_section(
    rig: Rig, libraries: Sequence[str], workloads: Sequence[CompletionWorkload]
) -> Section:
    draws = {workload.name: trial_lengths(workload) for workload in workloads}
    section: Section = {workload.name: {} for workload in workloads}
    for library in libraries:
        print(f"completion on {library}", file=sys.stderr, flush=True)
        _merge(section, run_on(library, _completion_rows, rig, library, workloads, draws))
    return section


# ----- the scan service ----------------------------------------------------------------------


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
        backend.launch(self.stamper, [lane.stamp_binding], [U64(0)], _ONE, _ONE, stream=lane.stream)
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
    stamper = await _load_spin_stamp(backend)
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
) -> tuple[float, float, float, _GcPauses]:
    """Run one task per lane beside a heartbeat: (process CPU s, wall s, worst lag s, GC)."""
    heartbeat = Heartbeat()
    with _GcPauses() as pauses:
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


async def _accy_service_rows(
    rig: Rig,
    library: str,
    workloads: Sequence[ServiceWorkload],
    tasks: Sequence[int],
    max_n: int,
) -> Section:
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


def _optional_cupy() -> tuple[Any, str]:
    """CuPy, or ``None`` and why it cannot be used."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - a missing baseline is reported
        return None, f"unavailable: {type(exc).__name__}: {exc}"
    return cupy, ""


def _service_section(
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
        measure = partial(_accy_service_rows, rig, library, workloads, tasks, max_n)
        shape = {workload.name: names for workload in workloads}
        _merge(section, run_on(library, _guarded, shape, measure))
    names = [f"CuPy cumsum via to_thread, {_tasks_label(c)} (asyncio)" for c in tasks]
    shape = {workload.name: names for workload in workloads}
    module, unavailable = cupy
    if module is None:
        _merge(
            section,
            {workload: dict.fromkeys(rows, unavailable) for workload, rows in shape.items()},
        )
    else:
        print("service: CuPy on asyncio", file=sys.stderr, flush=True)
        measure = partial(_cupy_service_rows, module, workloads, tasks, max_n)
        _merge(section, run_on("asyncio", _guarded, shape, measure))
    return section


# ----- cancellation ----------------------------------------------------------------------------

_CANCELLED_WAYS: Final = ("wait_event", "wait_stream", "download", "launch_pipeline")
"""The ways of waiting cancelled; the pipeline owns its scratch and kernels (no pool given)."""

_CANCEL_AFTER_S: Final = 5e-3
_KERNEL_NS: Final = 50_000_000


async def _cancellation_rows(library: str, trials: int) -> dict[str, Any]:
    """Cancel each way of waiting 5 ms into a 50 ms kernel: how soon control comes back."""
    from accy_async.backends.cuda import CudaBackend

    rows: dict[str, Any] = {}
    backend = CudaBackend()
    try:
        document = load_builtin("prefix_sum_i32")
        fmt = choose_format(backend, document)
        loaded = await _load_spin_stamp(backend)
        stamp, x, y = (backend.allocate_buffer(4096) for _ in range(3))
        stream, event = backend.create_stream(), backend.create_event()
        request = PipelineLaunch(
            pipeline=document.pipeline,
            registry=document.registry,
            format=fmt,
            operands=[x.bind("read_only")],
            results=[y.bind()],
            runtime_scalar_arguments=(U32(1024),),
            stream=stream,
        )
        ways: dict[str, Callable[[], Awaitable[Any]]] = {
            "wait_event": lambda: wait_event(backend, event),
            "wait_stream": lambda: wait_stream(backend, stream),
            "download": lambda: download(backend, y, np.int32, 1, stream=stream),
            "launch_pipeline": lambda: launch_pipeline(backend, request),
        }
        for way, wait in ways.items():
            samples = Samples()
            for _ in range(trials):
                backend.launch(loaded, [stamp.bind()], [U64(_KERNEL_NS)], _ONE, _ONE, stream=stream)
                backend.record_event(event, stream)
                cancelled_at = [0.0]
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as group:
                        group.start_soon(_cancel_later, scope, cancelled_at)
                        await wait()
                returned = time.perf_counter()
                samples.add((returned - cancelled_at[0]) * 1e6, wrong=not scope.cancelled_caught)
                await wait_stream(backend, stream)
            rows[f"accy {way}, cancelled ({library})"] = samples.summary(0.0)
        backend.destroy_all([loaded, stamp, x, y, stream, event])
    finally:
        await backend.aclose()
    return rows


async def _cancel_later(scope: anyio.CancelScope, cancelled_at: list[float]) -> None:
    await anyio.sleep(_CANCEL_AFTER_S)
    cancelled_at[0] = time.perf_counter()
    scope.cancel()


def _cancellation_section(libraries: Sequence[str], trials: int) -> Section:
    rows: dict[str, Any] = {}
    for library in libraries:
        print(f"cancellation on {library}", file=sys.stderr, flush=True)
        measure = partial(_cancellation_rows, library, trials)
        names = [f"accy {way}, cancelled ({library})" for way in _CANCELLED_WAYS]
        shape = {_CANCELLATION_WORKLOAD: names}
        part = run_on(library, _guarded, shape, _wrap_rows(measure))
        rows.update(part[_CANCELLATION_WORKLOAD])
    return {_CANCELLATION_WORKLOAD: rows}


_CANCELLATION_WORKLOAD: Final = "cancelled 5 ms into a 50 ms kernel"


def _wrap_rows(
    measure: Callable[[], Awaitable[dict[str, Any]]],
) -> Callable[[], Awaitable[Section]]:
    async def section() -> Section:
        return {_CANCELLATION_WORKLOAD: await measure()}

    return section


# ----- the run -------------------------------------------------------------------------------


def run_workload(
    *,
    quick: bool = False,
    libraries: Sequence[str] = LIBRARIES,
    sections: Sequence[str] = SECTIONS,
    small: tuple[int, int] = (1_000, 1_000_000),
    varied: tuple[int, int] = (100_000, 300_000_000),
    tasks: Sequence[int] = (1, 64),
) -> dict[str, Any]:
    """Run the chosen sections on each library; return the results as plain data."""
    completion = quick_workloads(COMPLETION_WORKLOADS) if quick else COMPLETION_WORKLOADS
    service = service_workloads(small, varied, quick=quick)
    rig = Rig()
    try:
        result: dict[str, Any] = {
            **describe_run(rig),
            "quick": quick,
            "libraries": list(libraries),
            "completion_trials": {workload.name: workload.trials for workload in completion},
            "service_requests": {workload.name: workload.requests for workload in service},
            "service_tasks": list(tasks),
        }
        cupy = _optional_cupy() if "service" in sections else (None, "")
        # CuPy's import (and the driver's) made objects a full collection would walk, pausing
        # the loop for milliseconds; freeze them, as a long-running service would.
        gc.collect()
        gc.freeze()
        if "completion" in sections:
            result["completion"] = _completion_section(rig, libraries, completion)
        if "service" in sections:
            result["service"] = _service_section(rig, libraries, service, tasks, cupy)
        if "cancellation" in sections:
            result["cancellation"] = _cancellation_section(libraries, 5 if quick else 20)
        return result
    finally:
        rig.close()


# ----- Markdown ------------------------------------------------------------------------------

Column: TypeAlias = tuple[str, str, str]
"""A table column: its heading, the row's key, the format of the value."""

_LATENCY_COLUMNS: Final[tuple[Column, ...]] = (
    ("median µs", "median_us", "{:.1f}"),
    ("p90 µs", "p90_us", "{:.1f}"),
    ("p99 µs", "p99_us", "{:.1f}"),
    ("CPU cores", "cpu_cores", "{:.2f}"),
)
COMPLETION_COLUMNS: Final[tuple[Column, ...]] = (
    ("trials", "count", "{:d}"),
    *_LATENCY_COLUMNS,
    ("CPU µs per wait", "cpu_us_per_wait", "{:.0f}"),
    ("worst heartbeat lag ms", "worst_heartbeat_lag_ms", "{:.2f}"),
    ("GC runs", "gc_pauses", "{:d}"),
    ("worst GC pause ms", "worst_gc_pause_ms", "{:.2f}"),
    ("wrong", "wrong", "{:d}"),
)
SERVICE_COLUMNS: Final[tuple[Column, ...]] = (
    ("requests", "count", "{:d}"),
    ("requests/s", "requests_per_s", "{:.0f}"),
    *_LATENCY_COLUMNS,
    ("CPU µs per request", "cpu_us_per_wait", "{:.0f}"),
    ("worst heartbeat lag ms", "worst_heartbeat_lag_ms", "{:.2f}"),
    ("GC runs", "gc_pauses", "{:d}"),
    ("worst GC pause ms", "worst_gc_pause_ms", "{:.2f}"),
    ("wrong", "wrong", "{:d}"),
)
_MARKED: Final = (("p99_us", "p99"), ("worst_heartbeat_lag_ms", "heartbeat lag"))

_COMPLETION_INTRO: Final = (
    "Microseconds from a kernel's end (its last `%globaltimer`, written to mapped host "
    "memory; the clocks related before each trial) until the awaiting task runs. CPU cores: "
    "the process's CPU time, every thread, over the waits' wall time (launch to resume). A "
    "task ticks every millisecond on the same loop; its worst lateness is the heartbeat lag. "
    "Wrong: waits that returned before the kernel's stamp landed. accy-async rows launch "
    "through the backend on its own stream; the baselines launch the rig's raw kernel and "
    "record a raw event."
)
_CANCELLATION_COLUMNS: Final[tuple[Column, ...]] = (
    ("trials", "count", "{:d}"),
    ("median µs", "median_us", "{:.1f}"),
    ("p90 µs", "p90_us", "{:.1f}"),
    ("p99 µs", "p99_us", "{:.1f}"),
    ("not cancelled", "wrong", "{:d}"),
)
_CANCELLATION_INTRO: Final = (
    "Microseconds from cancelling the caller's scope (from another task, 5 ms into a 50 ms "
    "kernel) until the cancelled call has given control back. What the device still uses "
    "goes to deferred release."
)
_SERVICE_INTRO: Final = (
    "Each task has its own stream, scratch and output; the input (all ones) and the kernel "
    "pool are shared. A request launches the `prefix_sum_i32` pipeline, a stamp kernel, and "
    "awaits the download of the last element, which must be `n` (wrong counts those that are "
    "not). accy-async latency: from the stamp to the task resuming (the clocks related before "
    "and after each row, while the device is idle). CPU cores: process CPU time over the "
    "row's wall time."
)


def sort_rows(rows: dict[str, Any]) -> list[str]:
    """Row names, accy-async's first, then the baselines, each group in its measured order."""
    return sorted(rows, key=lambda name: not name.startswith("accy"))


def _marks(rows: dict[str, Any]) -> dict[str, list[str]]:
    """The rows with the highest and lowest p99 and heartbeat lag (where they differ)."""
    marks: dict[str, list[str]] = {}
    for key, label in _MARKED:
        values = {
            name: row[key]
            for name, row in rows.items()
            if isinstance(row, dict) and row.get(key) is not None
        }
        if len(values) < 2 or max(values.values()) == min(values.values()):
            continue
        marks.setdefault(max(values, key=values.__getitem__), []).append(f"**worst {label}**")
        marks.setdefault(min(values, key=values.__getitem__), []).append(f"best {label}")
    return marks


def _cell(value: Any, form: str) -> str:
    return "" if value is None else form.format(value)


def table(rows: dict[str, Any], columns: Sequence[Column], first: str) -> list[str]:
    """One Markdown table: a row per entry, sorted and marked; text rows say why they are empty."""
    marks = _marks(rows)
    lines = [
        f"| {first} | " + " | ".join(heading for heading, _, _ in columns) + " | notes |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for name in sort_rows(rows):
        row = rows[name]
        if not isinstance(row, dict):
            lines.append(f"| {name} |" + " |" * len(columns) + f" {row} |")
            continue
        notes = [*marks.get(name, []), *([row["note"]] if row.get("note") else [])]
        cells = [_cell(row.get(key), form) for _, key, form in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'; '.join(notes)} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown: the set-up, then a table per workload of each section."""
    git = result["git"]
    revision = "unknown commit" if git["commit"] is None else f"commit {git['commit'][:12]}"
    if git["dirty"]:
        revision += " (with uncommitted changes)"
    lines = [
        f"# accy-async application workloads on {result['device']}",
        "",
        f"{result['date']}; {revision}; Python {result['python']}; "
        + ", ".join(f"{name} {version}" for name, version in result["versions"].items())
        + ("; **quick run**" if result["quick"] else ""),
    ]
    for key, title, intro, columns, first in (
        (
            "completion",
            "Completion latency",
            _COMPLETION_INTRO,
            COMPLETION_COLUMNS,
            "way of waiting",
        ),
        ("service", "Scan service", _SERVICE_INTRO, SERVICE_COLUMNS, "service"),
        ("cancellation", "Cancellation", _CANCELLATION_INTRO, _CANCELLATION_COLUMNS, "call"),
    ):
        if key not in result:
            continue
        lines += ["", f"## {title}", "", intro]
        for workload, rows in result[key].items():
            lines += ["", f"### {workload}", "", *table(rows, columns, first)]
    return "\n".join(lines) + "\n"


# ----- the command line ----------------------------------------------------------------------


def parse_size_range(text: str) -> tuple[int, int]:
    """``"1e3..1e6"`` as ``(1000, 1000000)``; sizes from 1 to 2**32 - 1, the first the smaller."""
    low_text, separator, high_text = text.partition("..")
    try:
        low, high = int(float(low_text)), int(float(high_text))
    except (ValueError, OverflowError):
        low = high = 0
    if not separator or not 1 <= low <= high <= 2**32 - 1:
        raise argparse.ArgumentTypeError(
            f"expected LOW..HIGH with 1 <= LOW <= HIGH <= 2**32 - 1 (such as 1e3..1e6), "
            f"got {text!r}"
        )
    return low, high


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options."""
    parser = argparse.ArgumentParser(
        prog="python -m accy_bench.workload", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the results")
    parser.add_argument("--quick", action="store_true", help="a fifth of the trials and requests")
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument(
        "--small",
        type=parse_size_range,
        default=(1_000, 1_000_000),
        metavar="LOW..HIGH",
        help="sizes of the small service requests (default 1e3..1e6)",
    )
    parser.add_argument(
        "--varied",
        type=parse_size_range,
        default=(100_000, 300_000_000),
        metavar="LOW..HIGH",
        help="sizes of the varied service requests (default 1e5..3e8)",
    )
    parser.add_argument(
        "--tasks", nargs="+", type=int, default=[1, 64], help="service concurrencies"
    )
    arguments = parser.parse_args(argv)
    if min(arguments.tasks) < 1:
        parser.error("--tasks must be positive")
    return arguments


def main(argv: Sequence[str] | None = None) -> int:
    """Run the workloads and write ``workload.json`` and ``workload.md`` to ``--out``."""
    arguments = parse_args(argv)
    if "completion" in arguments.sections:
        workloads = (
            quick_workloads(COMPLETION_WORKLOADS) if arguments.quick else COMPLETION_WORKLOADS
        )
        seconds = completion_seconds(workloads, len(arguments.libraries))
        print(f"completion section: about {seconds:.0f} s", file=sys.stderr, flush=True)
    result = run_workload(
        quick=arguments.quick,
        libraries=arguments.libraries,
        sections=arguments.sections,
        small=arguments.small,
        varied=arguments.varied,
        tasks=arguments.tasks,
    )
    out: Path = arguments.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "workload.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "workload.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
