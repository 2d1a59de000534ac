"""The completion section: from a kernel's end until the awaiting task runs, each way of waiting.

Kernels whose lengths are fixed, random, bimodal, queued eight deep, launched on
a stream created for the trial, or read from device memory. accy-async's waits
(each wait policy, ``wait_stream``, the completion reactor alone) beside polling
from the loop and ``to_thread(cuEventSynchronize)``, each row beside a heartbeat.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

import anyio
import anyio.lowlevel
import anyio.to_thread

from accy_async import U64, wait_event, wait_stream
from accy_async.waiting import sleep_until

from .latency import Heartbeat
from .rig import Rig, driver, ok, run_on
from .stamps import ONE, MappedStamps, load_spin_stamp
from .stats import SEED, GcPauses, Samples, Section, guarded, log_uniform, merge

if TYPE_CHECKING:
    from accy_async import BufferBinding, BufferHandle, EventHandle, LoadedArtifact, StreamHandle
    from accy_async.backends.cuda import CudaBackend

__all__ = [
    "ACCY_METHODS",
    "BASELINES",
    "COMPLETION_WORKLOADS",
    "AccyMethod",
    "CompletionWorkload",
    "accy_completion",
    "completion_seconds",
    "completion_section",
    "quick_workloads",
    "trial_lengths",
]

Policy: TypeAlias = Literal["latency", "balanced", "frugal"]
Waiter: TypeAlias = Callable[[Any, float], Awaitable[None]]
"""Waits, from the loop, for the work enqueued on a stream (a native stream or a handle);
the second argument is when the trial's kernels should end (a :func:`time.perf_counter`
instant), which only the oracle baseline reads."""

_GAP_S: Final = 0.5e-3
"""The pause between trials, slept on the loop's precise clock."""
_POLL_S: Final = 120e-6
"""The period of the loop-local polling baseline."""
_ORACLE_SLACK_S: Final = 30e-6
"""How long after the kernels' known end the oracle baseline wakes."""
_ORACLE_POLL_S: Final = 50e-6
"""The oracle's polls, should the kernels run past their known end (a fresh stream's first)."""
_TRIAL_OVERHEAD_S: Final = 0.65e-3
"""A trial's time beyond its kernels: the gap, two calibrations, launch and wake-up."""


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
    rng = random.Random(f"{SEED}/{workload.name}")
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


async def _poll_yield(event: Any, stream: Any, end: float) -> None:
    del end
    d = driver()
    ok(d.cuEventRecord(event, stream), "record")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY
    while d.cuEventQuery(event)[0] == not_ready:
        await anyio.lowlevel.checkpoint()


async def _poll_timer(event: Any, stream: Any, end: float) -> None:
    del end
    d = driver()
    ok(d.cuEventRecord(event, stream), "record")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY
    while d.cuEventQuery(event)[0] == not_ready:
        await sleep_until(time.perf_counter() + _POLL_S)


async def _to_thread(event: Any, stream: Any, end: float) -> None:
    del end
    d = driver()
    ok(d.cuEventRecord(event, stream), "record")
    ok(await anyio.to_thread.run_sync(d.cuEventSynchronize, event), "synchronize")


async def _oracle(event: Any, stream: Any, end: float) -> None:
    d = driver()
    ok(d.cuEventRecord(event, stream), "record")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY
    await sleep_until(end + _ORACLE_SLACK_S)
    while d.cuEventQuery(event)[0] == not_ready:
        await sleep_until(time.perf_counter() + _ORACLE_POLL_S)


BASELINES: Final[dict[str, Callable[[Any, Any, float], Awaitable[None]]]] = {
    "poll cuEventQuery + yield (the floor, burns a core)": _poll_yield,
    "poll cuEventQuery every 120 us on the loop's clock": _poll_timer,
    "to_thread(cuEventSynchronize)": _to_thread,
    "oracle: one sleep to the known end + 30 us (one wake-up's CPU floor)": _oracle,
}
"""The baselines: raw rig kernels and a raw event on the rig's stream. The oracle knows
each trial's kernel lengths, which no real wait does: its CPU is what one wake-up a wait
costs on this machine, beside the heartbeat and the launch (the floor for ``frugal``)."""


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
        backend.launch(loaded, buffers, [U64(ns)], ONE, stream=on)

    def launch_hidden(ns: int, on: StreamHandle) -> None:
        # The length goes to device memory first: the launch's arguments never change.
        assert hidden is not None
        kernel, length = hidden
        backend.write_buffer(length, ns.to_bytes(8, "little"), stream=on)
        backend.launch(kernel, [binding, length.bind("read_only")], [U64(0)], ONE, stream=on)

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

        async def on_stream(stream: StreamHandle, end: float) -> None:
            del end
            await wait_stream(backend, stream, policy=policy)

        return on_stream

    async def on_event(stream: StreamHandle, end: float) -> None:
        del end
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
    with GcPauses() as pauses:
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
            await wait(stream, wall + sum(lengths) * 1e-9)
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


async def accy_completion(
    rig: Rig,
    row: str,
    method: AccyMethod,
    workloads: Sequence[CompletionWorkload],
    draws: dict[str, list[tuple[int, ...]]],
) -> Section:
    """``method``'s row (named ``row``) of each workload, on a CUDA backend of its own."""
    from accy_async.backends.cuda import CudaBackend

    rows: Section = {}
    async with contextlib.AsyncExitStack() as stack:
        stamps = MappedStamps(1)
        stack.callback(stamps.close)
        backend = CudaBackend(anticipation=method.anticipation)
        stack.push_async_callback(backend.aclose)
        loaded = await load_spin_stamp(backend)
        hidden = (await load_spin_stamp(backend, hidden=True), backend.allocate_buffer(8))
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
        measure = partial(accy_completion, rig, row, method, workloads, draws)
        merge(section, await guarded({w.name: [row] for w in workloads}, measure))
    for label in BASELINES:
        row = f"{label} ({library})"
        measure = partial(_baseline_completion, rig, row, label, workloads, draws)
        merge(section, await guarded({w.name: [row] for w in workloads}, measure))
    return section


def completion_section(
    rig: Rig, libraries: Sequence[str], workloads: Sequence[CompletionWorkload]
) -> Section:
    """Every method's row of each workload, on each library's event loop in turn."""
    draws = {workload.name: trial_lengths(workload) for workload in workloads}
    section: Section = {workload.name: {} for workload in workloads}
    for library in libraries:
        print(f"completion on {library}", file=sys.stderr, flush=True)
        merge(section, run_on(library, _completion_rows, rig, library, workloads, draws))
    return section
