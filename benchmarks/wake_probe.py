"""Two questions the completion reactor's design rests on, answered on the GPU machine.

1. Does ``cuEventSynchronize`` (cuda-bindings) release the GIL while it blocks?
   The main thread counts while another thread waits 300 ms in it.
2. How long does a thread take to wake an event loop (``call_soon_threadsafe``
   or trio's ``run_sync_soon``) when the loop is idle, and when it is busy? On
   a virtual machine an idle loop's vCPU halts, and waking it costs an
   inter-processor interrupt through the hypervisor.
3. How late does a loop that wakes itself (its own timerfd, ``accy_async._loops``)
   resume after 100 us and 2 ms sleeps?

    python benchmarks/wake_probe.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel

from accy_async.backends.cuda.driver import driver, libc
from accy_bench import Rig


def gil_probe(rig: Rig, blocking_sync: bool) -> dict[str, Any]:
    d = driver()
    flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING | (
        d.CUevent_flags.CU_EVENT_BLOCKING_SYNC if blocking_sync else 0
    )
    _, event = d.cuEventCreate(flags)
    rig.launch_spin(300_000_000)
    d.cuEventRecord(event, rig.stream)
    done = threading.Event()

    def wait() -> None:
        d.cuCtxSetCurrent(rig.context)
        d.cuEventSynchronize(event)
        done.set()

    thread = threading.Thread(target=wait)
    start = time.perf_counter()
    thread.start()
    counted = 0
    while not done.is_set():
        counted += 1
    elapsed = time.perf_counter() - start
    thread.join()
    d.cuEventDestroy(event)
    return {
        "blocking_sync_event": blocking_sync,
        "main_thread_iterations": counted,
        "seconds": round(elapsed, 3),
        "iterations_per_ms": round(counted / elapsed / 1e3),
    }


def cpu_probe(rig: Rig, blocking_sync: bool) -> dict[str, Any]:
    """Process CPU used while a thread waits 300 ms in cuEventSynchronize (main thread asleep)."""
    d = driver()
    flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING | (
        d.CUevent_flags.CU_EVENT_BLOCKING_SYNC if blocking_sync else 0
    )
    _, event = d.cuEventCreate(flags)
    rig.launch_spin(300_000_000)
    d.cuEventRecord(event, rig.stream)
    cpu, wall = time.process_time(), time.perf_counter()

    def wait() -> None:
        d.cuCtxSetCurrent(rig.context)
        d.cuEventSynchronize(event)

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join()
    cores = (time.process_time() - cpu) / (time.perf_counter() - wall)
    d.cuEventDestroy(event)
    return {"blocking_sync_event": blocking_sync, "cpu_cores": round(cores, 3)}


def lock_probe(rig: Rig, blocking_sync: bool) -> dict[str, Any]:
    """How long driver calls from this thread take while another waits in cuEventSynchronize."""
    d = driver()
    flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING | (
        d.CUevent_flags.CU_EVENT_BLOCKING_SYNC if blocking_sync else 0
    )
    _, event = d.cuEventCreate(flags)
    _, other = d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    _, side = d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING)
    rig.launch_spin(300_000_000)
    d.cuEventRecord(event, rig.stream)
    d.cuEventRecord(other, rig.stream)
    started = threading.Event()

    def wait() -> None:
        d.cuCtxSetCurrent(rig.context)
        started.set()
        d.cuEventSynchronize(event)

    thread = threading.Thread(target=wait)
    thread.start()
    started.wait()
    time.sleep(0.01)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    for _ in range(100):
        d.cuEventQuery(other)
    timings["cuEventQuery_us"] = (time.perf_counter() - start) / 100 * 1e6
    start = time.perf_counter()
    for _ in range(100):
        d.cuLaunchKernel(rig.empty, 1, 1, 1, 32, 1, 1, 0, side, rig.params, 0)
    timings["cuLaunchKernel_us"] = (time.perf_counter() - start) / 100 * 1e6
    start = time.perf_counter()
    for _ in range(100):
        d.cuEventRecord(other, side)
    timings["cuEventRecord_us"] = (time.perf_counter() - start) / 100 * 1e6
    thread.join()
    d.cuStreamSynchronize(side)
    for handle in (event, other):
        d.cuEventDestroy(handle)
    d.cuStreamDestroy(side)
    return {"blocking_sync_event": blocking_sync, **{k: round(v, 2) for k, v in timings.items()}}


def wake_probe(library: str, busy: bool, trials: int = 200) -> dict[str, Any]:
    async def body() -> list[float]:
        latencies: list[float] = []
        stop = False

        async def spinner() -> None:
            while not stop:
                await anyio.lowlevel.checkpoint()

        def waker(deliver: Any, delay: float) -> None:
            libc().prctl(29, 1, 0, 0, 0)
            time.sleep(delay)
            deliver(time.perf_counter_ns())

        async with anyio.create_task_group() as group:
            if busy:
                group.start_soon(spinner)
            for index in range(trials):
                delay = 100e-6 if index % 2 else 2e-3
                if library == "trio":
                    import trio

                    token = trio.lowlevel.current_trio_token()
                    box: dict[str, int] = {}
                    ready = trio.Event()

                    def deliver_trio(
                        t: int, box: dict[str, int] = box, ready: Any = ready, token: Any = token
                    ) -> None:
                        box["t"] = t
                        token.run_sync_soon(ready.set)

                    thread = threading.Thread(target=waker, args=(deliver_trio, delay))
                    thread.start()
                    await ready.wait()
                    sent = box["t"]
                else:
                    loop = asyncio.get_running_loop()
                    future: asyncio.Future[int] = loop.create_future()

                    def deliver(t: int, future: Any = future, loop: Any = loop) -> None:
                        loop.call_soon_threadsafe(future.set_result, t)

                    thread = threading.Thread(target=waker, args=(deliver, delay))
                    thread.start()
                    sent = await future
                latencies.append((time.perf_counter_ns() - sent) / 1e3)
                thread.join()
            stop = True
        return latencies

    if library == "uvloop":
        latencies = anyio.run(body, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        latencies = anyio.run(body, backend=library)
    latencies.sort()
    return {
        "library": library,
        "loop_busy": busy,
        "median_us": round(statistics.median(latencies), 1),
        "p90_us": round(latencies[int(len(latencies) * 0.9)], 1),
    }


def alarm_probe(library: str, trials: int = 200) -> dict[str, Any]:
    """How late a task resumes after an alarm of its loop's clock (``accy_async._loops``).

    The loop is idle meanwhile, so its vCPU halts; on Linux the loop's own
    timerfd wakes it, with no second thread involved.
    """
    from accy_async import _loops

    async def body() -> dict[str, Any]:
        clock = _loops.current().clock
        lateness: dict[str, list[float]] = {"100us": [], "2ms": []}
        for index in range(trials):
            label, delay = ("100us", 100e-6) if index % 2 else ("2ms", 2e-3)
            when = time.perf_counter() + delay
            await _loops.sleep_until(when)
            lateness[label].append((time.perf_counter() - when) * 1e6)
        row: dict[str, Any] = {"library": library, "clock": type(clock).__name__}
        for label, values in lateness.items():
            values.sort()
            row[f"{label}_median_us"] = round(statistics.median(values), 1)
            row[f"{label}_p90_us"] = round(values[int(len(values) * 0.9)], 1)
        return row

    if library == "uvloop":
        return anyio.run(body, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(body, backend=library)


def ten_thousand() -> dict[str, Any]:
    """Time parking 10,000 waiters behind a 2 s kernel."""
    from tests.kernels import spec

    import accy_async as accy
    from accy_async.backends.cuda import CudaBackend

    async def body() -> dict[str, Any]:
        backend = CudaBackend()
        slow = await backend.load_artifact(
            await backend.create_artifact(spec(backend, "slow_fill_f32"))
        )
        buffer = backend.allocate_buffer(64)
        streams = [backend.create_stream() for _ in range(4)]
        events = [backend.create_event() for _ in range(10_000)]
        start = time.perf_counter()
        for stream in streams:
            backend.launch(
                slow,
                [buffer.bind()],
                [accy.U32(1), accy.F32(1), accy.U64(2_000_000_000)],
                accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
                stream=stream,
            )
        for index, event in enumerate(events):
            backend.record_event(event, streams[index % 4])
        enqueued = time.perf_counter() - start
        completed = 0

        async def waiter(event: Any) -> None:
            nonlocal completed
            await accy.wait_event(backend, event)
            completed += 1

        async with anyio.create_task_group() as group:
            for event in events:
                group.start_soon(waiter, event)
            await anyio.lowlevel.checkpoint()
            parked = time.perf_counter() - start
            completed_when_parked = completed
        done = time.perf_counter() - start
        backend.destroy_all([slow, buffer, *streams, *events])
        await backend.aclose()
        return {
            "enqueued_s": round(enqueued, 3),
            "parked_s": round(parked, 3),
            "completed_when_parked": completed_when_parked,
            "all_done_s": round(done, 3),
        }

    return anyio.run(body)


def main() -> None:
    rig = Rig()
    results: dict[str, Any] = {
        "gil": [gil_probe(rig, False), gil_probe(rig, True)],
        "driver_lock": [lock_probe(rig, False), lock_probe(rig, True)],
        "cpu": [cpu_probe(rig, False), cpu_probe(rig, True)],
    }
    rig.close()
    results["wake"] = [
        wake_probe(library, busy)
        for library in ("asyncio", "uvloop", "trio")
        for busy in (False, True)
    ]
    results["alarm"] = [alarm_probe(library) for library in ("asyncio", "uvloop", "trio")]
    print(json.dumps(results, indent=2))
    paths = [argument for argument in sys.argv[1:] if not argument.startswith("--")]
    if paths:
        with open(paths[0], "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
