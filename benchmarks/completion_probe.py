"""The questions behind accy-async's completion design, answered on the GPU machine.

1. **Flag writes or event queries?** cutile-rs's ``cuda-async`` marks progress with
   ``cuStreamWriteValue32`` into host-mapped memory that one thread scans. Against
   ``cuEventRecord`` + ``cuEventQuery``: the host cost to enqueue each kind of mark,
   to query one, the latency from a kernel's end to a task that polls it from the
   loop, a reactor thread's CPU while it watches, and whether data copied to the
   host before a flag is visible when the flag is.
2. **How predictable are kernel lengths?** The built-in prefix sum's device time
   over sizes from 1e3 to 3e8 (a cost model learns ``a + b * n`` from completions),
   and how long a launch on an idle stream takes to start on the device.
3. **What does a yield cost?** ``asyncio.sleep(0)``, uvloop's, trio's checkpoint.

    python benchmarks/completion_probe.py [OUT.json]
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from accy_async.backends.cuda.driver import driver, libc
from accy_bench.rig import Rig
from accy_bench.rig import ok as _ok

BATCH = 256


def _median_us(run: Callable[[], object], repeat: int = 20, per: int = BATCH) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) / per * 1e6)
    return round(statistics.median(samples), 3)


class Slab:
    """Host-mapped pinned words that the device writes with ``cuStreamWriteValue32``."""

    def __init__(self, words: int = 4096) -> None:
        d = driver()
        flags = int(d.CU_MEMHOSTALLOC_DEVICEMAP) | int(d.CU_MEMHOSTALLOC_PORTABLE)
        self.host = int(_ok(d.cuMemHostAlloc(4 * words, flags), "host alloc"))
        self.device = int(_ok(d.cuMemHostGetDevicePointer(self.host, 0), "device pointer"))
        self.words = (ctypes.c_uint32 * words).from_address(self.host)
        ctypes.memset(self.host, 0, 4 * words)

    def close(self) -> None:
        driver().cuMemFreeHost(self.host)


def enqueue_costs(rig: Rig, slab: Slab) -> dict[str, Any]:
    d = driver()
    stream = rig.stream
    plain = _ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "event")
    timed = _ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DEFAULT), "event")
    write = d.cuStreamWriteValue32
    record = d.cuEventRecord
    default = d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    address = slab.device
    rows: dict[str, Any] = {}
    calls: dict[str, Callable[[], object]] = {
        "cuEventRecord, timing off": lambda: record(plain, stream),
        "cuEventRecord, timing on": lambda: record(timed, stream),
        "cuStreamWriteValue32 to mapped host memory": lambda: write(stream, address, 1, default),
        "cuLaunchKernel, pre-packed": lambda: d.cuLaunchKernel(
            rig.empty, 1, 1, 1, 32, 1, 1, 0, stream, rig.params, 0
        ),
    }

    def repeated(call: Callable[[], object], count: int) -> Callable[[], object]:
        return lambda: [call() for _ in range(count)]

    for name, call in calls.items():
        rows[name + " (idle stream)"] = _median_us(repeated(call, BATCH))
        rig.sync()
        # Behind a running kernel: few enough that the driver's queue never fills.
        rig.launch_spin(200_000_000)
        record(plain, stream)
        rows[name + " (behind a running kernel)"] = _median_us(repeated(call, 64), 5, 64)
        rows["cuEventQuery, pending"] = _median_us(
            repeated(lambda: d.cuEventQuery(plain), 64), 5, 64
        )
        rig.sync()
    rows["cuEventQuery, complete"] = _median_us(
        lambda: [d.cuEventQuery(plain) for _ in range(BATCH)]
    )
    words = slab.words
    rows["flag read (ctypes array item)"] = _median_us(lambda: [words[7] for _ in range(BATCH)])
    d.cuEventDestroy(plain)
    d.cuEventDestroy(timed)
    return rows


def ordering(rig: Rig, slab: Slab, trials: int = 2000) -> dict[str, Any]:
    """Copies to pinned memory land before a flag written after them is seen."""
    d = driver()
    size = 1 << 20
    device = int(_ok(d.cuMemAlloc(size), "alloc"))
    host = int(_ok(d.cuMemHostAlloc(size, 0), "pinned"))
    view = (ctypes.c_uint32 * (size // 4)).from_address(host)
    bad = 0
    flag_index = 11
    for trial in range(1, trials + 1):
        _ok(d.cuMemsetD32Async(device, trial, size // 4, rig.stream), "memset")
        rig.launch_spin(20_000)
        _ok(d.cuMemcpyDtoHAsync(host, device, size, rig.stream), "copy")
        _ok(
            d.cuStreamWriteValue32(rig.stream, slab.device + 4 * flag_index, trial, 0),
            "write value",
        )
        while slab.words[flag_index] != trial:
            pass
        if view[0] != trial or view[size // 4 - 1] != trial:
            bad += 1
    rig.sync()
    d.cuMemFree(device)
    d.cuMemFreeHost(host)
    return {"trials": trials, "data_not_yet_landed_when_flag_seen": bad}


def loop_latency(rig: Rig, slab: Slab, library: str, spin_ns: int, trials: int) -> dict[str, Any]:
    """Tight polling from the loop (yield between polls): event query vs flag read."""
    d = driver()
    event = _ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "event")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY
    words = slab.words

    async def body() -> dict[str, Any]:
        d.cuCtxSetCurrent(rig.context)
        rows: dict[str, Any] = {}
        for how in ("cuEventQuery", "flag"):
            latencies = []
            polls = 0
            cpu = wall = 0.0
            for trial in range(1, trials + 1):
                rig.calibrate(2)
                c0, w0 = time.process_time(), time.perf_counter()
                rig.launch_spin(spin_ns)
                if how == "flag":
                    _ok(d.cuStreamWriteValue32(rig.stream, slab.device, trial, 0), "write")
                    while words[0] != trial:
                        polls += 1
                        await anyio.lowlevel.checkpoint()
                else:
                    _ok(d.cuEventRecord(event, rig.stream), "record")
                    while d.cuEventQuery(event)[0] == not_ready:
                        polls += 1
                        await anyio.lowlevel.checkpoint()
                resumed = time.time_ns()
                cpu += time.process_time() - c0
                wall += time.perf_counter() - w0
                latencies.append(rig.latency_us(resumed))
            latencies.sort()
            rows[how] = {
                "median_us": round(statistics.median(latencies), 1),
                "p90_us": round(latencies[int(0.9 * len(latencies))], 1),
                "cpu_cores": round(cpu / wall, 2),
                "polls_per_wait": round(polls / trials),
                "us_per_poll": round(wall / max(polls, 1) * 1e6, 2),
            }
        return rows

    try:
        if library == "uvloop":
            return anyio.run(body, backend="asyncio", backend_options={"use_uvloop": True})
        return anyio.run(body, backend=library)
    finally:
        d.cuEventDestroy(event)


def reactor_cpu(rig: Rig, slab: Slab, watches: int, interval: float) -> dict[str, Any]:
    """A thread watching ``watches`` pending marks behind a 300 ms kernel: its CPU."""
    d = driver()
    events = [
        _ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "event")
        for _ in range(watches)
    ]
    rows: dict[str, Any] = {}
    for how in ("cuEventQuery of the oldest", "flag scan"):
        rig.launch_spin(300_000_000)
        for index, event in enumerate(events):
            d.cuEventRecord(event, rig.stream)
            d.cuStreamWriteValue32(rig.stream, slab.device + 4 * (100 + index), 7, 0)
        stop = threading.Event()
        sweeps = [0]

        def run(how: str = how, stop: threading.Event = stop, sweeps: list[int] = sweeps) -> None:
            d.cuCtxSetCurrent(rig.context)
            libc().prctl(29, 1, 0, 0, 0)
            not_ready = d.CUresult.CUDA_ERROR_NOT_READY
            words = slab.words
            while not stop.is_set():
                if how == "flag scan":
                    for index in range(watches):
                        if words[100 + index] == 7:
                            break
                elif d.cuEventQuery(events[0])[0] != not_ready:
                    break
                sweeps[0] += 1
                time.sleep(interval)

        c0, w0 = time.process_time(), time.perf_counter()
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.2)
        stop.set()
        thread.join()
        rows[how] = {
            "cpu_cores": round((time.process_time() - c0) / (time.perf_counter() - w0), 3),
            "sweeps_per_ms": round(sweeps[0] / 200, 1),
        }
        rig.sync()
        ctypes.memset(slab.host + 400, 0, 4 * watches)
    for event in events:
        d.cuEventDestroy(event)
    return rows


def launch_to_start(rig: Rig, trials: int = 200) -> dict[str, Any]:
    """From cuLaunchKernel's return to the kernel's first instruction, on an idle stream."""
    d = driver()
    source = r"""
    extern "C" __global__ void stamp_start(volatile unsigned long long* stamp) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        *stamp = now;
        __threadfence_system();
    }
    """
    from accy_async.backends.cuda.nvrtc import compile_source

    image = compile_source(source, "start", (), rig.cc)
    module = _ok(d.cuModuleLoadData(image.image), "load")
    function = _ok(d.cuModuleGetFunction(module, b"stamp_start"), "function")
    slots = (ctypes.c_uint64 * 1)(rig.stamp_device)
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(slots))
    delays = []
    for _ in range(trials):
        rig.calibrate(2)
        rig.stamp.value = 0
        d.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, rig.stream, ctypes.addressof(pointers), 0)
        returned = time.time_ns()
        rig.sync()
        delays.append((rig.stamp.value + rig.clock_offset - returned) / 1e3)
        time.sleep(0.0005)
    d.cuModuleUnload(module)
    delays.sort()
    return {
        "median_us": round(statistics.median(delays), 2),
        "p10_us": round(delays[len(delays) // 10], 2),
        "p90_us": round(delays[int(0.9 * len(delays))], 2),
    }


def scan_times() -> dict[str, Any]:
    """Device time of the built-in prefix sum (i32) over sizes 1e3..3e8, three runs each."""
    import numpy as np

    import accy_async as accy
    from accy_async.backends.cuda import CudaBackend
    from accy_async.pipeline import choose_format

    async def body() -> dict[str, Any]:
        backend = CudaBackend()
        document = accy.library.load_builtin("prefix_sum_i32")
        fmt = choose_format(backend, document)
        pipeline, registry = document.pipeline, document.registry
        pool = await accy.load_pipeline_artifacts(backend, pipeline, registry, fmt)
        top = 300_000_000
        x = backend.allocate_buffer(4 * top)
        y = backend.allocate_buffer(4 * top)
        backend.fill_buffer(x, 1)
        stream = backend.create_stream()
        start, end = backend.create_event(timing=True), backend.create_event(timing=True)
        scratch = await accy.allocate_pipeline_intermediates(backend, pipeline, (accy.U32(top),))
        rows = []
        sizes = sorted({int(v) for v in np.logspace(3, math.log10(top), 36)})
        for n in sizes:
            times = []
            for _ in range(3):
                backend.record_event(start, stream)
                await accy.launch_pipeline(
                    backend,
                    accy.PipelineLaunch(
                        pipeline=pipeline,
                        registry=registry,
                        format=fmt,
                        operands=[x.bind("read_only", byte_size=4 * n)],
                        results=[y.bind(byte_size=4 * n)],
                        runtime_scalar_arguments=(accy.U32(n),),
                        intermediates=scratch,
                        artifacts=pool,
                        stream=stream,
                    ),
                )
                backend.record_event(end, stream)
                await accy.wait_event(backend, end)
                times.append(backend.elapsed_seconds(start, end) * 1e6)
            rows.append({"n": n, "device_us": [round(t, 1) for t in times]})
        last = await accy.download(backend, y, np.int32, 1, offset=4 * (sizes[-1] - 1))
        await scratch.aclose()
        await pool.aclose()
        backend.destroy_all([x, y, stream, start, end])
        await backend.aclose()
        return {"rows": rows, "check_last": int(last[0]), "expected_last": sizes[-1]}

    return anyio.run(body)


def yield_costs() -> dict[str, Any]:
    n = 100_000

    async def asyncio_sleep0() -> float:
        start = time.perf_counter()
        for _ in range(n):
            await asyncio.sleep(0)
        return (time.perf_counter() - start) / n * 1e6

    async def trio_checkpoint() -> float:
        import trio

        start = time.perf_counter()
        for _ in range(n):
            await trio.lowlevel.checkpoint()
        return (time.perf_counter() - start) / n * 1e6

    return {
        "asyncio sleep(0) us": round(anyio.run(asyncio_sleep0), 3),
        "uvloop sleep(0) us": round(
            anyio.run(asyncio_sleep0, backend_options={"use_uvloop": True}), 3
        ),
        "trio checkpoint us": round(anyio.run(trio_checkpoint, backend="trio"), 3),
    }


def main() -> None:
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    rig = Rig()
    rig.calibrate()
    slab = Slab()
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("yield_costs", yield_costs),
        ("enqueue_and_query_us", lambda: enqueue_costs(rig, slab)),
        ("flag_after_copy", lambda: ordering(rig, slab)),
        ("launch_to_start", lambda: launch_to_start(rig)),
        (
            "reactor_cpu",
            lambda: {
                f"{watches} watches, sleep {int(interval * 1e6)} us": reactor_cpu(
                    rig, slab, watches, interval
                )
                for watches in (1, 64)
                for interval in (50e-6, 200e-6)
            },
        ),
        (
            "loop_poll_latency",
            lambda: {
                f"{library}, {label}": loop_latency(rig, slab, library, spin, trials)
                for library in ("asyncio", "uvloop", "trio")
                for label, spin, trials in (("100us", 100_000, 150), ("2ms", 2_000_000, 40))
            },
        ),
        ("prefix_sum_i32_device_time", scan_times),
    ]
    for name, step in steps:
        started = time.perf_counter()
        try:
            results[name] = step()
        except Exception as exc:  # a probe that fails is reported, the rest run
            results[name] = f"failed: {type(exc).__name__}: {exc}"
        print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    slab.close()
    rig.close()
    text = json.dumps(results, indent=2)
    print(text)
    paths = [argument for argument in sys.argv[1:] if not argument.startswith("--")]
    if paths:
        with open(paths[0], "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
