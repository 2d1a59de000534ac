"""Completion latency: from a kernel's end until the awaiting code runs, each way of waiting."""

from __future__ import annotations

import asyncio
import ctypes
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from accy_async import wait_event, wait_read, wait_stream
from accy_async.waiting import sleep_until

from .rig import Rig, driver, ok, run_on

__all__ = ["Heartbeat", "run_latency"]


class Heartbeat:
    """Ticks every millisecond on the loop and remembers the worst lateness."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - start - 0.001)


async def _trials(
    rig: Rig,
    spin_ns: int,
    trials: int,
    launch_and_wait: Callable[[], Awaitable[None]],
) -> dict[str, Any]:
    heartbeat = Heartbeat()
    latencies = []
    cpu = wall = 0.0
    async with anyio.create_task_group() as group:
        group.start_soon(heartbeat.run)
        for _ in range(trials):
            rig.calibrate(3)  # the GPU and host clocks drift apart: relate them per trial
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            await launch_and_wait()
            resumed = time.time_ns()
            cpu += time.process_time() - cpu_start
            wall += time.perf_counter() - wall_start
            latencies.append(rig.latency_us(resumed))
            # The gap between trials sleeps on the precise clock: a 0.5 ms loop timer would
            # be rounded up to the selector's millisecond and hold the heartbeat up with it.
            await sleep_until(time.perf_counter() + 0.0005)
        group.cancel_scope.cancel()
    latencies.sort()
    return {
        "median_us": statistics.median(latencies),
        "p90_us": latencies[int(len(latencies) * 0.9)],
        "worst_heartbeat_lag_ms": heartbeat.worst * 1e3,
        "cpu_cores": cpu / wall,  # process CPU over the waits themselves
        "cpu_us_per_wait": cpu / trials * 1e6,
    }


async def _heartbeat_alone(seconds: float) -> dict[str, Any]:
    """The heartbeat's worst lag on a loop doing nothing else: what the machine itself adds."""
    heartbeat = Heartbeat()
    with anyio.move_on_after(seconds):
        await heartbeat.run()
    return {
        "median_us": None,
        "p90_us": None,
        "worst_heartbeat_lag_ms": heartbeat.worst * 1e3,
        "cpu_cores": None,
        "cpu_us_per_wait": None,
    }


async def _latency_rows(rig: Rig, spin_ns: int, trials: int, library: str) -> dict[str, Any]:
    """Each way of waiting, on the event loop library running this coroutine."""
    d = driver()
    rows: dict[str, Any] = {
        f"nothing: the heartbeat alone, as long as the trials ({library})": (
            await _heartbeat_alone(min(trials * (spin_ns * 1e-9 + 1.5e-3), 2.0))
        )
    }
    event = ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "event")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY

    def launch() -> None:
        rig.launch_spin(spin_ns)
        ok(d.cuEventRecord(event, rig.stream), "record")

    if library == "asyncio":

        async def blocking() -> None:
            launch()
            d.cuEventSynchronize(event)

        rows["cuEventSynchronize on the loop thread"] = await _trials(
            rig, spin_ns, trials, blocking
        )

        async def poll_yield() -> None:
            launch()
            while d.cuEventQuery(event)[0] == not_ready:
                await anyio.lowlevel.checkpoint()

        rows["poll cuEventQuery + sleep(0)"] = await _trials(rig, spin_ns, trials, poll_yield)

        async def poll_backoff() -> None:
            launch()
            delay = 10e-6
            while d.cuEventQuery(event)[0] == not_ready:
                await anyio.sleep(delay)
                delay = min(delay * 2, 1e-3)

        rows["poll with backoff 10 us -> 1 ms"] = await _trials(rig, spin_ns, trials, poll_backoff)

        async def poll_ms() -> None:
            launch()
            while d.cuEventQuery(event)[0] == not_ready:  # noqa: ASYNC110 - the anchor
                await anyio.sleep(1e-3)

        rows["poll every 1 ms"] = await _trials(rig, spin_ns, trials, poll_ms)

        async def to_thread() -> None:
            launch()
            await anyio.to_thread.run_sync(d.cuEventSynchronize, event)

        rows["to_thread(cuEventSynchronize)"] = await _trials(rig, spin_ns, trials, to_thread)
    if library in ("asyncio", "uvloop"):
        host_function_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        loop = asyncio.get_running_loop()
        state: dict[str, asyncio.Future[None]] = {}

        def python_callback(_: Any) -> None:
            loop.call_soon_threadsafe(state["future"].set_result, None)

        callback = host_function_type(python_callback)
        function_pointer = d.CUhostFn(ctypes.cast(callback, ctypes.c_void_p).value)

        async def host_function() -> None:
            state["future"] = loop.create_future()
            launch()
            ok(d.cuLaunchHostFunc(rig.stream, function_pointer, 0), "host func")
            await state["future"]

        rows[
            f"cuLaunchHostFunc Python callback -> call_soon_threadsafe ({library})"
        ] = await _trials(rig, spin_ns, trials, host_function)
    rows.update(await _accy_rows(rig, spin_ns, trials, library))
    d.cuEventDestroy(event)
    return rows


async def _accy_rows(rig: Rig, spin_ns: int, trials: int, library: str) -> dict[str, Any]:
    from accy_async.backends.cuda import CudaBackend

    rows: dict[str, Any] = {}
    reactors: tuple[tuple[str, float, bool], ...] = (
        ("anticipated, loop-local alarm (default)", 50e-6, True),
        ("reactor only, poll 50 us", 50e-6, False),
        ("reactor only, poll 10 us", 10e-6, False),
    )
    for label, interval, anticipation in reactors:
        backend = CudaBackend(poll_interval=interval, anticipation=anticipation)
        try:
            stream = backend.create_stream()
            event = backend.create_event()

            async def accy_wait(
                backend: CudaBackend = backend, stream: Any = stream, event: Any = event
            ) -> None:
                rig.launch_spin(spin_ns, stream.native)
                backend.record_event(event, stream)
                await wait_event(backend, event)

            rows[f"accy wait_event, {label} ({library})"] = await _trials(
                rig, spin_ns, trials, accy_wait
            )
            if anticipation:

                async def accy_stream_wait(
                    backend: CudaBackend = backend, stream: Any = stream
                ) -> None:
                    rig.launch_spin(spin_ns, stream.native)
                    await wait_stream(backend, stream)

                rows[
                    f"accy wait_stream (what launch_pipeline awaits), {label} ({library})"
                ] = await _trials(rig, spin_ns, trials, accy_stream_wait)
                small = backend.allocate_buffer(256)

                async def accy_read(
                    backend: CudaBackend = backend, stream: Any = stream, small: Any = small
                ) -> None:
                    rig.launch_spin(spin_ns, stream.native)
                    await wait_read(backend.enqueue_read(small, byte_size=4, stream=stream))

                rows[
                    f"accy wait_read of 4 bytes after the kernel, {label} ({library})"
                ] = await _trials(rig, spin_ns, trials, accy_read)
                backend.destroy(small)
            backend.destroy_all([event, stream])
        finally:
            await backend.aclose()
    return rows


def run_latency(rig: Rig, library: str, spin_ns: int, trials: int) -> dict[str, Any]:
    """Every way of waiting for ``spin_ns`` kernels, on ``library``'s event loop."""

    async def body() -> dict[str, Any]:
        driver().cuCtxSetCurrent(rig.context)
        return await _latency_rows(rig, spin_ns, trials, library)

    return run_on(library, body)
