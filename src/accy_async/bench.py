"""``accy-async bench``: launch cost and completion latency on the GPU, beside their anchors.

Everything is measured in one run, on one device, so ratios are meaningful:

* **launch cost**, host microseconds per kernel launch: raw ``cuLaunchKernel``
  with a pre-packed ``void*`` array (the anchor) and with a ``(values, types)``
  tuple; cuda.core, CuPy and PyTorch when they are installed; accy-async's
  ``backend.launch``, one stage of ``await launch_pipeline`` (pool and
  intermediates given) and one node of ``launch_graph``;
* **completion latency**, microseconds from a kernel's end (its last
  ``%globaltimer`` reading, written to mapped host memory) until the awaiting
  code runs, for 100 µs and 2 ms kernels: blocking ``cuEventSynchronize``,
  polling loops, a Python host-function callback, ``to_thread``, and
  accy-async's ``wait_event`` on asyncio, uvloop and trio with each reactor;
  with the worst lag of a 1 ms heartbeat and the process CPU used per second
  of waiting.

The GPU and host clocks are related by timing, from the host, how long a
kernel's stamp takes to appear in mapped memory (its minimum is taken as the
offset), so the latencies include no launch time.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from .backends.cuda_driver import driver

__all__ = ["main", "run_benchmarks"]

KERNELS = r"""
extern "C" __global__ void empty(float* out, const float* in, unsigned n) {}

extern "C" __global__ void spin_then_stamp(unsigned long long ns,
                                            volatile unsigned long long* stamp) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *stamp = now;
    __threadfence_system();
}
"""

BATCH = 256


def _ok(result: Any, action: str) -> Any:
    code = result[0] if isinstance(result, tuple) else result
    if int(code):
        raise RuntimeError(f"{action} failed: {code}")
    if isinstance(result, tuple) and len(result) == 2:
        return result[1]
    return None


class Rig:
    """A raw driver set-up for the anchors: context, stream, module, mapped stamp."""

    def __init__(self) -> None:
        from .backends.nvrtc import compile_source

        d = driver()
        _ok(d.cuInit(0), "cuInit")
        self.device = _ok(d.cuDeviceGet(0), "cuDeviceGet")
        self.context = _ok(d.cuDevicePrimaryCtxRetain(self.device), "retain")
        _ok(d.cuCtxSetCurrent(self.context), "set current")
        attribute = d.CUdevice_attribute
        major = _ok(
            d.cuDeviceGetAttribute(
                attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device
            ),
            "cc",
        )
        minor = _ok(
            d.cuDeviceGetAttribute(
                attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device
            ),
            "cc",
        )
        self.cc = (int(major), int(minor))
        self.image = compile_source(KERNELS, "bench", (), self.cc)
        self.module = _ok(d.cuModuleLoadData(self.image.image), "load")
        self.empty = _ok(d.cuModuleGetFunction(self.module, b"empty"), "empty")
        self.spin = _ok(d.cuModuleGetFunction(self.module, b"spin_then_stamp"), "spin")
        self.stream = _ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
        self.a = int(_ok(d.cuMemAlloc(1024), "alloc"))
        self.b = int(_ok(d.cuMemAlloc(1024), "alloc"))
        flags = d.CU_MEMHOSTALLOC_DEVICEMAP if hasattr(d, "CU_MEMHOSTALLOC_DEVICEMAP") else 2
        self.stamp_host = int(_ok(d.cuMemHostAlloc(8, flags), "host alloc"))
        self.stamp_device = int(_ok(d.cuMemHostGetDevicePointer(self.stamp_host, 0), "map"))
        self.stamp = ctypes.c_uint64.from_address(self.stamp_host)
        # Pre-packed arguments of `empty`.
        self.slots = (ctypes.c_uint64 * 3)(self.a, self.b, 0)
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * 3)(base, base + 8, base + 16)
        self.params = ctypes.addressof(self.pointers)
        # Arguments of `spin_then_stamp`.
        self.spin_slots = (ctypes.c_uint64 * 2)(0, self.stamp_device)
        spin_base = ctypes.addressof(self.spin_slots)
        self.spin_pointers = (ctypes.c_void_p * 2)(spin_base, spin_base + 8)
        self.spin_params = ctypes.addressof(self.spin_pointers)
        self.clock_offset = 0

    def sync(self) -> None:
        _ok(driver().cuStreamSynchronize(self.stream), "sync")

    def launch_spin(self, ns: int, stream: Any = None) -> None:
        self.stamp.value = 0
        self.spin_slots[0] = ns
        d = driver()
        (result,) = d.cuLaunchKernel(
            self.spin,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream if stream is not None else self.stream,
            self.spin_params,
            0,
        )
        if int(result):
            raise RuntimeError(f"launch failed: {result}")

    def calibrate(self, trials: int = 200) -> int:
        """Host minus GPU clock, plus the least time a stamp takes to reach the host.

        A zero-length kernel writes its ``%globaltimer`` to mapped memory while
        the host spins reading it; the smallest (host time seen - stamp) over
        ``trials`` is the offset. A spinning host sees the stamp within a
        microsecond or two, so latencies measured against it are, if anything,
        that much too short.
        """
        offsets = []
        for _ in range(trials):
            self.launch_spin(0)
            while self.stamp.value == 0:
                pass
            seen = time.time_ns()
            offsets.append(seen - self.stamp.value)
            self.sync()
        self.clock_offset = min(offsets)
        return self.clock_offset

    def latency_us(self, resumed_ns: int) -> float:
        return (resumed_ns - self.stamp.value - self.clock_offset) / 1e3

    def close(self) -> None:
        d = driver()
        d.cuStreamSynchronize(self.stream)
        d.cuMemFree(self.a)
        d.cuMemFree(self.b)
        d.cuMemFreeHost(self.stamp_host)
        d.cuModuleUnload(self.module)
        d.cuStreamDestroy(self.stream)
        d.cuDevicePrimaryCtxRelease(self.device)


# ----- launch cost -------------------------------------------------------------------------


def _per_call_us(run_batch: Callable[[], None], sync: Callable[[], None], repeat: int) -> float:
    run_batch()
    sync()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run_batch()
        samples.append((time.perf_counter() - start) / BATCH * 1e6)
        sync()
    return statistics.median(samples)


async def _paired_us(
    raw_batch: Callable[[], None],
    accy_batch: Callable[[], Awaitable[None]],
    sync: Callable[[], Awaitable[None]],
    repeat: int,
    launches_per_batch: int = BATCH,
) -> dict[str, float]:
    """accy-async beside the raw pre-packed launch, batches interleaved, GC paused.

    Timing the two alternately on the same kernel and stream cancels the slow
    drifts of a shared machine that separate runs would put into the ratio.
    """
    raw_samples: list[float] = []
    accy_samples: list[float] = []
    for round_index in range(repeat + 1):
        for which in ("raw", "accy"):
            gc.disable()
            start = time.perf_counter()
            if which == "raw":
                raw_batch()
            else:
                await accy_batch()
            elapsed = (time.perf_counter() - start) / launches_per_batch * 1e6
            gc.enable()
            await sync()
            if round_index:  # the first round warms up
                (raw_samples if which == "raw" else accy_samples).append(elapsed)
    return {"us": statistics.median(accy_samples), "raw_us": statistics.median(raw_samples)}


def launch_anchors(rig: Rig, repeat: int) -> dict[str, Any]:
    d = driver()
    rows: dict[str, Any] = {}
    launch = d.cuLaunchKernel
    function, stream, params = rig.empty, rig.stream, rig.params

    def prepacked() -> None:
        for _ in range(BATCH):
            launch(function, 1, 1, 1, 32, 1, 1, 0, stream, params, 0)

    rows["cuLaunchKernel, pre-packed void* array"] = _per_call_us(prepacked, rig.sync, repeat)
    types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)

    def tupled() -> None:
        for _ in range(BATCH):
            launch(function, 1, 1, 1, 32, 1, 1, 0, stream, ((rig.a, rig.b, 0), types), 0)

    rows["cuLaunchKernel, ((values), (types)) tuple"] = _per_call_us(tupled, rig.sync, repeat)
    rows.update(_optional_anchors(rig, repeat))
    return rows


def _optional_anchors(rig: Rig, repeat: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    try:
        from cuda.core import Device, LaunchConfig, ObjectCode, launch

        device = Device(0)
        device.set_current()
        core_stream = device.create_stream()
        kernel = ObjectCode.from_cubin(rig.image.image).get_kernel("empty")
        config = LaunchConfig(grid=1, block=32)
        import numpy as np

        a, b = rig.a, rig.b
        n = np.uint32(0)

        def core() -> None:
            for _ in range(BATCH):
                launch(core_stream, config, kernel, a, b, n)

        rows["cuda.core launch"] = _per_call_us(core, core_stream.sync, repeat)
    except Exception as exc:  # noqa: BLE001 - an anchor that cannot run is reported
        rows["cuda.core launch"] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        import cupy
        import numpy as np

        raw = cupy.RawKernel(KERNELS, "empty")
        x = cupy.zeros(8, dtype=cupy.float32)
        cupy_stream = cupy.cuda.Stream(non_blocking=True)
        n32 = np.uint32(0)

        def cupy_calls() -> None:
            with cupy_stream:
                for _ in range(BATCH):
                    raw((1,), (32,), (x, x, n32))

        rows["CuPy RawKernel call"] = _per_call_us(cupy_calls, cupy_stream.synchronize, repeat)
    except Exception as exc:  # noqa: BLE001
        rows["CuPy RawKernel call"] = f"unavailable: {type(exc).__name__}: {exc}"
    try:
        import torch

        t = torch.zeros(8, device="cuda")

        def torch_calls() -> None:
            for _ in range(BATCH):
                t.add_(1)

        rows["PyTorch x.add_(1)"] = _per_call_us(torch_calls, torch.cuda.synchronize, repeat)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for _ in range(3):
                t.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(100):
                t.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) / 100 * 1e6)
        rows["CUDA graph replay, per node (PyTorch, 100 nodes, GPU time included)"] = (
            statistics.median(samples)
        )
    except Exception as exc:  # noqa: BLE001
        rows["PyTorch x.add_(1)"] = f"unavailable: {type(exc).__name__}: {exc}"
    return rows


async def launch_accy(repeat: int) -> dict[str, Any]:
    """accy-async's launch paths on its CUDA backend."""
    from . import plan as p
    from .backends import open_backend
    from .graph import launch_graph
    from .kernels import SlotBinding, load_kernels
    from .pipeline import (
        PipelineLaunch,
        allocate_pipeline_intermediates,
        launch_pipeline,
        load_pipeline_artifacts,
    )
    from .waiting import wait_stream

    rows: dict[str, Any] = {}
    empty = p.TextPayload(KERNELS)
    async with open_backend("cuda") as backend:
        spec = p.ArtifactSpec(
            kernel_name="empty",
            format=p.ArtifactFormat.CUDA_SOURCE,
            payload=empty,
            argument_count=3,
            scalar_argument_count=1,
        )
        loaded = await backend.load_artifact(await backend.create_artifact(spec))
        a, b = backend.allocate_buffer(1024), backend.allocate_buffer(1024)
        buffers = [a.bind(), b.bind("read_only")]
        scalars = [p.U32(0)]
        stream = backend.create_stream()

        async def sync() -> None:
            # Spin like the anchors' cuStreamSynchronize, so every variant starts its
            # batch on an equally warm CPU (an idle vCPU wakes slow and cold).
            driver().cuStreamSynchronize(stream.native)
            await wait_stream(backend, stream)

        async def checked() -> None:
            for _ in range(BATCH):
                backend.launch(loaded, buffers, scalars, (1, 1, 1), (32, 1, 1), stream=stream)

        d = driver()
        raw_launch = d.cuLaunchKernel
        native = loaded.native
        backend.launch(loaded, buffers, scalars, (1, 1, 1), (32, 1, 1), stream=stream)  # packs

        def raw() -> None:
            for _ in range(BATCH):
                raw_launch(native.function, 1, 1, 1, 32, 1, 1, 0, stream.native, native.params, 0)

        rows["accy backend.launch (checked)"] = await _paired_us(raw, checked, sync, repeat)

        entry = p.RegistryEntry(
            target="bench.empty",
            version=1,
            format=p.ArtifactFormat.CUDA_SOURCE,
            entry_name="empty",
            argument_count=3,
            runtime_scalar_argument_count=1,
            payload=empty,
            launch=p.FixedLaunch(geometry=p.LaunchGeometry(block=(32, 1, 1))),
        )
        registry = p.KernelCallRegistry(entries=(entry,))
        pipeline = p.KernelCallPipeline(
            target="bench.three_stages",
            version=1,
            operand_count=1,
            result_count=1,
            runtime_scalar_argument_count=1,
            intermediates=(p.PipelineIntermediate(dtype=p.DType.F32, extent=p.Fixed(256)),),
            stages=(
                p.PipelineStage(
                    target="bench.empty",
                    version=1,
                    buffers=(p.Intermediate(0), p.Operand(0)),
                    scalars=(p.Forward(argument_index=0),),
                ),
                p.PipelineStage(
                    target="bench.empty",
                    version=1,
                    buffers=(p.Result(0), p.Intermediate(0)),
                    scalars=(p.Forward(argument_index=0),),
                ),
                p.PipelineStage(
                    target="bench.empty",
                    version=1,
                    buffers=(p.Result(0), p.Operand(0)),
                    scalars=(p.Forward(argument_index=0),),
                ),
            ),
        )
        arguments = (p.U32(0),)
        pool = await load_pipeline_artifacts(
            backend, pipeline, registry, p.ArtifactFormat.CUDA_SOURCE
        )
        scratch = await allocate_pipeline_intermediates(backend, pipeline, arguments)
        request = PipelineLaunch(
            pipeline=pipeline,
            registry=registry,
            format=p.ArtifactFormat.CUDA_SOURCE,
            operands=[b.bind("read_only")],
            results=[a.bind()],
            runtime_scalar_arguments=arguments,
            intermediates=scratch,
            artifacts=pool,
            stream=stream,
        )

        async def pipelines() -> None:
            for _ in range(BATCH // 3):
                await launch_pipeline(backend, request)

        rows["accy await launch_pipeline, per stage (pool + intermediates)"] = await _paired_us(
            raw, pipelines, sync, repeat, launches_per_batch=BATCH // 3 * 3
        )

        planned = p.PlannedKernel(
            kernel_id=1,
            work_item_id=1,
            artifact=spec,
            output_slot_id=1,
            input_slot_ids=(2,),
            runtime_scalar_argument_count=1,
            runtime_scalar_defaults=(p.U32(0),),
            launch_resources=p.LaunchResources(geometry=p.LaunchGeometry(block=(32, 1, 1))),
        )
        artifact_plan = p.ArtifactPlan(
            slots=(p.Slot(slot_id=1), p.Slot(slot_id=2)), kernels=(planned,)
        )
        graph = p.LaunchGraphPlan(nodes=tuple(p.GraphNode(kernel_index=0) for _ in range(BATCH)))
        kernels = await load_kernels(backend, artifact_plan)
        slots = [SlotBinding(1, a.bind()), SlotBinding(2, b.bind())]

        async def graph_nodes() -> None:
            await launch_graph(kernels, slots, graph, default_stream=stream)

        rows["accy launch_graph, per node (host order)"] = await _paired_us(
            raw, graph_nodes, sync, repeat
        )
        await kernels.aclose()
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([loaded, a, b, stream])
    return rows


# ----- completion latency ------------------------------------------------------------------


class Heartbeat:
    """Ticks every millisecond on the loop and remembers the worst lateness."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
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
    from .alarms import alarm_clock

    clock = alarm_clock()
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
            await clock.sleep_until(time.perf_counter() + 0.0005)
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


async def latency_rows(rig: Rig, spin_ns: int, trials: int, library: str) -> dict[str, Any]:
    """Each way of waiting, on the event loop library running this coroutine."""
    d = driver()
    rows: dict[str, Any] = {
        f"nothing: the heartbeat alone, as long as the trials ({library})": (
            await _heartbeat_alone(min(trials * (spin_ns * 1e-9 + 1.5e-3), 2.0))
        )
    }
    event = _ok(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "event")
    not_ready = d.CUresult.CUDA_ERROR_NOT_READY

    def launch() -> None:
        rig.launch_spin(spin_ns)
        _ok(d.cuEventRecord(event, rig.stream), "record")

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
            _ok(d.cuLaunchHostFunc(rig.stream, function_pointer, 0), "host func")
            await state["future"]

        rows[
            f"cuLaunchHostFunc Python callback -> call_soon_threadsafe ({library})"
        ] = await _trials(rig, spin_ns, trials, host_function)
    rows.update(await _accy_rows(rig, spin_ns, trials, library))
    d.cuEventDestroy(event)
    return rows


async def _accy_rows(rig: Rig, spin_ns: int, trials: int, library: str) -> dict[str, Any]:
    from .backends.cuda import CudaBackend
    from .waiting import wait_event, wait_read, wait_stream

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


def _run_latency(rig: Rig, library: str, spin_ns: int, trials: int) -> dict[str, Any]:
    async def body() -> dict[str, Any]:
        driver().cuCtxSetCurrent(rig.context)
        return await latency_rows(rig, spin_ns, trials, library)

    if library == "uvloop":
        return anyio.run(body, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(body, backend=library)


def run_benchmarks(
    repeat: int = 20,
    trials_short: int = 200,
    trials_long: int = 60,
    libraries: tuple[str, ...] = ("asyncio", "uvloop", "trio"),
) -> dict[str, Any]:
    """Run every measurement; return the results as plain data."""
    rig = Rig()
    try:
        result: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "device": _device_name(rig),
            "versions": _versions(),
            "clock_offset_ns": rig.calibrate(),
        }
        result["launch_us"] = launch_anchors(rig, repeat)
        result["launch_us"].update(anyio.run(launch_accy, repeat))
        result["latency"] = {}
        # The anchors imported torch and CuPy: hundreds of thousands of objects a full
        # collection would walk, pausing the loop for milliseconds. A long-running service
        # freezes what it loaded at start-up; so does this run, so that the heartbeat
        # measures the waiting rather than a collection of the anchors' modules.
        gc.collect()
        gc.freeze()
        for label, spin_ns, trials in (
            ("100us", 100_000, trials_short),
            ("2ms", 2_000_000, trials_long),
        ):
            rows: dict[str, Any] = {}
            for library in libraries:
                rows.update(_run_latency(rig, library, spin_ns, trials))
            result["latency"][label] = rows
        return result
    finally:
        rig.close()


def _device_name(rig: Rig) -> str:
    d = driver()
    raw = _ok(d.cuDeviceGetName(256, rig.device), "name")
    name = raw.split(b"\0", 1)[0].decode()
    return f"{name} (sm_{rig.cc[0]}{rig.cc[1]})"


def _versions() -> dict[str, str]:
    from importlib import metadata

    d = driver()
    versions = {"driver": str(_ok(d.cuDriverGetVersion(), "driver version"))}
    for name in (
        "cuda-bindings",
        "cuda-core",
        "anyio",
        "msgspec",
        "numpy",
        "trio",
        "uvloop",
        "cupy-cuda13x",
        "torch",
    ):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    from .backends.nvrtc import nvrtc_version

    versions["nvrtc"] = ".".join(map(str, nvrtc_version()))
    return versions


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown tables."""
    anchor = result["launch_us"].get("cuLaunchKernel, pre-packed void* array")
    lines = [
        f"# accy-async on {result['device']}",
        "",
        f"{result['date']}; Python {result['python']}; "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        "",
        "## Launch cost (host µs per launch, median of batches of 256)",
        "",
        "| what | µs | x pre-packed cuLaunchKernel |",
        "|---|---|---|",
    ]
    for name, value in result["launch_us"].items():
        if isinstance(value, dict):  # accy-async, timed interleaved with its own raw launch
            lines.append(
                f"| {name} | {value['us']:.2f} | {value['us'] / value['raw_us']:.2f} "
                f"(raw {value['raw_us']:.2f} interleaved) |"
            )
        elif isinstance(value, float) and anchor:
            lines.append(f"| {name} | {value:.2f} | {value / anchor:.2f} |")
        else:
            lines.append(f"| {name} | {value} | |")
    for label, rows in result["latency"].items():
        lines += [
            "",
            f"## Completion latency, {label} kernel (µs from the kernel's end until the "
            "waiter runs)",
            "",
            "A task ticks every millisecond beside the waits (its worst lateness is the "
            "heartbeat lag); CPU cores are the process's CPU time over the waits' wall "
            "time, every thread counted, and per wait (launch and record included); "
            "start-up objects were frozen (`gc.freeze()`) before these trials.",
            "",
            "| way of waiting | median µs | p90 µs | worst heartbeat lag ms | CPU cores "
            "| CPU µs per wait |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            if row["median_us"] is None:
                lines.append(f"| {name} | | | {row['worst_heartbeat_lag_ms']:.2f} | | |")
                continue
            lines.append(
                f"| {name} | {row['median_us']:.1f} | {row['p90_us']:.1f} | "
                f"{row['worst_heartbeat_lag_ms']:.2f} | {row['cpu_cores']:.2f} | "
                f"{row.get('cpu_us_per_wait', float('nan')):.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write ``bench.json`` and ``bench.md`` to ``--out``."""
    parser = argparse.ArgumentParser(prog="accy-async bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for bench.json and bench.md")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--trials-short", type=int, default=200)
    parser.add_argument("--trials-long", type=int, default=60)
    parser.add_argument("--libraries", nargs="+", default=["asyncio", "uvloop", "trio"])
    args = parser.parse_args(argv)
    result = run_benchmarks(args.repeat, args.trials_short, args.trials_long, tuple(args.libraries))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(result))
    print(markdown(result))
    return 0
