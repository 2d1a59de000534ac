"""Launch cost: host microseconds per launch, accy-async beside raw ``cuLaunchKernel``."""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.lowlevel
import msgspec

from accy_async import (
    BufferHandle,
    LaunchConfig,
    PipelineLaunch,
    SlotBinding,
    allocate_pipeline_intermediates,
    launch_graph,
    launch_pipeline,
    load_kernels,
    load_pipeline_artifacts,
    open_backend,
    open_pipeline,
    trace,
    wait_stream,
)
from accy_async import plan as p

from .graphs import GraphRig, device_graph_rows
from .rig import BATCH, KERNELS, Rig, driver, paired_us

__all__ = ["RING", "launch_accy", "launch_anchors"]

RING = 8
"""Operand and result pairs that the new-buffers row launches in turn."""


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


def launch_anchors(rig: Rig, repeat: int) -> dict[str, Any]:
    """The raw launches and the other libraries' launch calls."""
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
        from cuda.core import Device, ObjectCode, launch
        from cuda.core import LaunchConfig as CoreLaunchConfig

        device = Device(0)
        device.set_current()
        core_stream = device.create_stream()
        kernel = ObjectCode.from_cubin(rig.image.image).get_kernel("empty")
        config = CoreLaunchConfig(grid=1, block=32)
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

        one_warp = LaunchConfig((1, 1, 1), (32, 1, 1))

        async def checked() -> None:
            for _ in range(BATCH):
                backend.launch(loaded, buffers, scalars, one_warp, stream=stream)

        d = driver()
        raw_launch = d.cuLaunchKernel
        native = loaded.native  # its CUfunction and packed arguments (accy_async.backends.cuda)
        backend.launch(loaded, buffers, scalars, one_warp, stream=stream)  # packs

        def raw() -> None:
            for _ in range(BATCH):
                raw_launch(native.function, 1, 1, 1, 32, 1, 1, 0, stream.native, native.params, 0)

        rows["accy backend.launch (checked)"] = await paired_us(raw, checked, sync, repeat)
        with trace(backend):  # two timing events per launch: the device's start and end
            rows["accy backend.launch (checked), traced"] = await paired_us(
                raw, checked, sync, repeat
            )
        with trace(backend, device_times=False):  # the host's spans only
            rows["accy backend.launch (checked), traced, host spans only"] = await paired_us(
                raw, checked, sync, repeat
            )
        _, timing_event = d.cuEventCreate(0)  # the floor of device times: the events' records

        async def two_records() -> None:
            for _ in range(BATCH):
                d.cuEventRecord(timing_event, stream.native)
                d.cuEventRecord(timing_event, stream.native)

        rows[
            "cuEventRecord x2 of a timing event (a traced launch's device-time floor)"
        ] = await paired_us(raw, two_records, sync, repeat)
        d.cuEventDestroy(timing_event)

        async def checkpoints() -> None:
            for _ in range(BATCH):
                await anyio.lowlevel.checkpoint()

        rows[
            "await anyio.lowlevel.checkpoint() alone (every async launch is a checkpoint)"
        ] = await paired_us(raw, checkpoints, sync, repeat)

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
            device_graph=False,  # stage by stage: the graph rows come separately
        )

        async def pipelines() -> None:
            for _ in range(BATCH // 3):
                await launch_pipeline(backend, request)

        rows["accy await launch_pipeline, per stage (pool + intermediates)"] = await paired_us(
            raw, pipelines, sync, repeat, launches_per_batch=BATCH // 3 * 3
        )

        def fresh(
            plan: p.KernelCallPipeline,
            plan_pool: Any,
            graph: bool | None = None,
            operand: BufferHandle = b,
            result: BufferHandle = a,
        ) -> PipelineLaunch:
            return PipelineLaunch(
                pipeline=plan,
                registry=registry,
                format=p.ArtifactFormat.CUDA_SOURCE,
                operands=(operand.bind("read_only"),),
                results=(result.bind(),),
                runtime_scalar_arguments=arguments,
                intermediates=scratch if plan.intermediates else (),
                artifacts=plan_pool,
                stream=stream,
                device_graph=graph,
            )

        async def fresh_pipelines() -> None:
            for _ in range(BATCH // 3):
                await launch_pipeline(backend, fresh(pipeline, pool))

        rows[
            "accy await launch_pipeline, fresh request each call, default (one graph once its "
            "geometry recurs), per stage (3 stages)"
        ] = await paired_us(raw, fresh_pipelines, sync, repeat, launches_per_batch=BATCH // 3 * 3)
        ring = [backend.allocate_buffer(1024) for _ in range(2 * RING)]

        async def fresh_buffers() -> None:
            for index in range(BATCH // 3):
                slot = 2 * (index % RING)
                request = fresh(pipeline, pool, None, ring[slot], ring[slot + 1])
                await launch_pipeline(backend, request)

        rows[
            f"accy await launch_pipeline, fresh request and new buffers each call ({RING} pairs "
            "in turn), default, per stage (3 stages)"
        ] = await paired_us(raw, fresh_buffers, sync, repeat, launches_per_batch=BATCH // 3 * 3)

        async def fresh_stage_by_stage() -> None:
            for _ in range(BATCH // 3):
                await launch_pipeline(backend, fresh(pipeline, pool, False))

        rows[  # the name this row had before the default took graphs (device_graph=False)
            "accy await launch_pipeline, fresh request each call, per stage (3 stages)"
        ] = await paired_us(
            raw, fresh_stage_by_stage, sync, repeat, launches_per_batch=BATCH // 3 * 3
        )
        one_stage = msgspec.structs.replace(
            pipeline, target="bench.one_stage", intermediates=(), stages=(pipeline.stages[2],)
        )
        one_pool = await load_pipeline_artifacts(
            backend, one_stage, registry, p.ArtifactFormat.CUDA_SOURCE
        )

        async def fresh_single() -> None:
            for _ in range(BATCH):
                await launch_pipeline(backend, fresh(one_stage, one_pool))

        rows["accy await launch_pipeline, fresh request each call, 1 stage"] = await paired_us(
            raw, fresh_single, sync, repeat
        )
        rows.update(await _high_level_rows(backend, one_stage, registry, raw, sync, repeat))
        await one_pool.aclose()

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
            await launch_graph(kernels, slots, graph, default_stream=stream, device_graph=False)

        rows["accy launch_graph, per node (host order)"] = await paired_us(
            raw, graph_nodes, sync, repeat
        )
        await kernels.aclose()
        rows.update(
            await device_graph_rows(
                GraphRig(backend, loaded, spec, a, b, stream, request, pool), raw, sync, repeat
            )
        )
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([loaded, a, b, stream, *ring])
    return rows


async def _high_level_rows(
    backend: Any,
    pipeline: Any,
    registry: Any,
    raw: Callable[[], None],
    sync: Callable[[], Awaitable[None]],
    repeat: int,
) -> dict[str, Any]:
    """``open_pipeline``'s call on CuPy arrays, 1 stage: enqueue only, and until complete."""
    rows: dict[str, Any] = {}
    try:
        import cupy
    except ImportError as exc:
        rows["accy high-level call (CuPy in and out), enqueue, 1 stage"] = f"unavailable: {exc}"
        return rows
    shape = p.PipelineBuffer(name="x", dtype=p.DType.F32, extent=p.Fixed(256))
    document = p.PipelineDocument(
        pipeline=pipeline,
        registry=registry,
        operands=(shape,),
        results=(p.PipelineBuffer(name="y", dtype=p.DType.F32, extent=p.Fixed(256)),),
        runtime_scalar_names=("n",),
    )
    n = p.U32(0)
    x = cupy.zeros(256, dtype=cupy.float32)
    y = cupy.zeros(256, dtype=cupy.float32)
    consumer = cupy.cuda.Stream(non_blocking=True)
    async with open_pipeline(document, backend=backend, max_lanes=1) as call:
        with consumer:

            async def enqueue() -> None:
                for _ in range(BATCH):
                    await call(x, out=y, n=n)

            async def until_complete() -> None:
                for _ in range(BATCH // 8):
                    await call(x, out=y, n=n)
                    await wait_stream(backend, consumer.ptr)

            async def sync_all() -> None:
                await sync()
                consumer.synchronize()

            rows["accy high-level call (CuPy in and out), enqueue, 1 stage"] = await paired_us(
                raw, enqueue, sync_all, repeat
            )
            rows[
                "accy high-level call (CuPy), enqueue + await completion, 1 stage"
            ] = await paired_us(raw, until_complete, sync_all, repeat, BATCH // 8)
    return rows
