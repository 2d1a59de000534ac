"""Launch cost as one device graph, beside the same work launched node by node (same run).

Rows per node (or per stage), each paired with the raw pre-packed
``cuLaunchKernel`` interleaved with it (the 100-node rows time four launches a
batch, new arguments every launch where the row says so): the 3-stage pipeline relaunched (one
submission, nothing patched) and with a fresh request each call (every stage
patched); a 100-node launch graph with the same buffers and with new buffers
each call, as a graph and node by node; the same with 100 distinct nodes (10
kernels, a scalar of its own each node), new buffers each call; and the
backend's graph launch with new pointers and scalars for all 100 nodes each call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from accy_async import (
    BufferHandle,
    LoadedArtifact,
    PipelineLaunch,
    SlotBinding,
    StreamHandle,
    launch_graph,
    launch_pipeline,
    load_kernels,
)
from accy_async import plan as p
from accy_async.backends import Backend, GraphNode, LaunchConfig

from .rig import BATCH, paired_us

__all__ = ["DISTINCT_KERNELS", "GRAPH_LAUNCHES", "GRAPH_NODES", "GraphRig", "device_graph_rows"]

GRAPH_NODES = 100
"""Nodes of the launch-graph rows (the issue's 100-node graph)."""
GRAPH_LAUNCHES = 4
"""Launches of the 100-node graph per timed batch (the raw rows time 256 launches a batch)."""


@dataclass(frozen=True, slots=True)
class GraphRig:
    """What the launch rows set up: the empty kernel, two buffers, a stream, the 3-stage request."""

    backend: Backend
    loaded: LoadedArtifact
    spec: p.ArtifactSpec
    a: BufferHandle
    b: BufferHandle
    stream: StreamHandle
    request: PipelineLaunch
    """The 3-stage pipeline through its pool and scratch (its ``device_graph`` is replaced)."""
    pool: Any


async def device_graph_rows(
    rig: GraphRig,
    raw: Callable[[], None],
    sync: Callable[[], Awaitable[None]],
    repeat: int,
) -> dict[str, Any]:
    """The device-graph rows; see the module docstring."""
    rows: dict[str, Any] = {}
    backend, stream = rig.backend, rig.stream
    stages = 3
    calls = BATCH // stages  # as many requests a batch as the stage-by-stage pipeline rows

    relaunched = msgspec.structs.replace(rig.request, device_graph=True)

    async def pipeline_relaunched() -> None:
        for _ in range(calls):
            await launch_pipeline(backend, relaunched)

    await launch_pipeline(backend, relaunched)  # instantiates
    rows[
        "accy await launch_pipeline as one device graph, relaunched request, per stage"
    ] = await paired_us(raw, pipeline_relaunched, sync, repeat, launches_per_batch=calls * stages)

    async def pipeline_fresh() -> None:
        for _ in range(calls):
            await launch_pipeline(backend, msgspec.structs.replace(relaunched))

    rows[
        "accy await launch_pipeline as one device graph, fresh request each call, per stage"
    ] = await paired_us(raw, pipeline_fresh, sync, repeat, launches_per_batch=calls * stages)

    planned = p.PlannedKernel(
        kernel_id=1,
        work_item_id=1,
        artifact=rig.spec,
        output_slot_id=1,
        input_slot_ids=(2,),
        runtime_scalar_argument_count=1,
        runtime_scalar_defaults=(p.U32(0),),
        launch_resources=p.LaunchResources(geometry=p.LaunchGeometry(block=(32, 1, 1))),
    )
    artifact_plan = p.ArtifactPlan(slots=(p.Slot(slot_id=1), p.Slot(slot_id=2)), kernels=(planned,))
    graph = p.LaunchGraphPlan(nodes=tuple(p.GraphNode(kernel_index=0) for _ in range(GRAPH_NODES)))
    spare_a, spare_b = backend.allocate_buffer(1024), backend.allocate_buffer(1024)
    binding_sets = [
        [SlotBinding(1, rig.a.bind()), SlotBinding(2, rig.b.bind())],
        [SlotBinding(1, spare_a.bind()), SlotBinding(2, spare_b.bind())],
    ]
    async with await load_kernels(backend, artifact_plan) as kernels:
        for device_graph in (True, False):
            rows.update(
                await _launch_graph_rows(
                    kernels, graph, binding_sets, stream, device_graph, raw, sync, repeat
                )
            )
    rows.update(await _distinct_nodes_rows(rig, planned, raw, sync, repeat))
    rows.update(await _backend_graph_row(rig, spare_a, spare_b, raw, sync, repeat))
    backend.destroy_all([spare_a, spare_b])
    return rows


DISTINCT_KERNELS = 10
"""Planned kernels of the distinct-nodes rows: a chain over their slots, each its own load."""


async def _distinct_nodes_rows(
    rig: GraphRig,
    planned: p.PlannedKernel,
    raw: Callable[[], None],
    sync: Callable[[], Awaitable[None]],
    repeat: int,
) -> dict[str, Any]:
    """A 100-node launch graph whose every node is a launch of its own: new buffers each call.

    Node ``i`` runs kernel ``i % 10`` of a chain (kernel ``k`` reads slot
    ``k + 1`` and writes slot ``k + 2``) with the scalar ``i``: 100 distinct
    launches over 10 loaded kernels and 11 slots, bound to one of two buffer
    sets in turn, as one device graph and node by node.
    """
    backend, stream = rig.backend, rig.stream
    plan = p.ArtifactPlan(
        slots=tuple(p.Slot(slot_id=k + 1) for k in range(DISTINCT_KERNELS + 1)),
        kernels=tuple(
            msgspec.structs.replace(
                planned, kernel_id=k + 1, work_item_id=k + 1, output_slot_id=k + 2,
                input_slot_ids=(k + 1,),
            )
            for k in range(DISTINCT_KERNELS)
        ),
    )  # fmt: skip
    graph = p.LaunchGraphPlan(
        nodes=tuple(
            p.GraphNode(kernel_index=i % DISTINCT_KERNELS, runtime_scalar_arguments=(p.U32(i),))
            for i in range(GRAPH_NODES)
        )
    )
    buffers = [backend.allocate_buffer(1024) for _ in range(2 * (DISTINCT_KERNELS + 1))]
    binding_sets = [
        [
            SlotBinding(k + 1, buffers[turn * (DISTINCT_KERNELS + 1) + k].bind())
            for k in range(DISTINCT_KERNELS + 1)
        ]
        for turn in range(2)
    ]
    rows: dict[str, Any] = {}
    async with await load_kernels(backend, plan) as kernels:
        for device_graph in (True, False):
            rows.update(
                await _launch_graph_rows(
                    kernels,
                    graph,
                    binding_sets,
                    stream,
                    device_graph,
                    raw,
                    sync,
                    repeat,
                    name=f"{GRAPH_NODES} distinct nodes ({DISTINCT_KERNELS} kernels)",
                    same_buffers=False,
                )
            )
    backend.destroy_all(buffers)
    return rows


async def _launch_graph_rows(
    kernels: Any,
    graph: p.LaunchGraphPlan,
    binding_sets: list[list[SlotBinding]],
    stream: StreamHandle,
    device_graph: bool,
    raw: Callable[[], None],
    sync: Callable[[], Awaitable[None]],
    repeat: int,
    *,
    name: str = f"{GRAPH_NODES} nodes",
    same_buffers: bool = True,
) -> dict[str, Any]:
    """``graph`` launched with new buffers each call, and with the same (``same_buffers``)."""
    how = "as one device graph" if device_graph else "node by node"
    await launch_graph(
        kernels, binding_sets[0], graph, default_stream=stream, device_graph=device_graph
    )
    await sync()

    async def same() -> None:
        for _ in range(GRAPH_LAUNCHES):
            await launch_graph(
                kernels, binding_sets[0], graph, default_stream=stream, device_graph=device_graph
            )

    turn = [0]

    async def new() -> None:
        for _ in range(GRAPH_LAUNCHES):
            turn[0] += 1
            await launch_graph(
                kernels,
                binding_sets[turn[0] % 2],
                graph,
                default_stream=stream,
                device_graph=device_graph,
            )

    name = f"accy launch_graph {how}, {name}"
    per_batch = GRAPH_NODES * GRAPH_LAUNCHES
    rows = {}
    if same_buffers:
        rows[f"{name}, same buffers, per node"] = await paired_us(
            raw, same, sync, repeat, launches_per_batch=per_batch
        )
    rows[f"{name}, new buffers each call, per node"] = await paired_us(
        raw, new, sync, repeat, launches_per_batch=per_batch
    )
    return rows


async def _backend_graph_row(
    rig: GraphRig,
    spare_a: BufferHandle,
    spare_b: BufferHandle,
    raw: Callable[[], None],
    sync: Callable[[], Awaitable[None]],
    repeat: int,
) -> dict[str, Any]:
    """The backend's graph launch with new pointers and scalars for every node each call.

    Twice: nodes patched by the driver (before the kernel is prepared for
    graphs), then nodes reading their arguments from the graph's device table.
    """
    backend, stream = rig.backend, rig.stream
    one_warp = LaunchConfig((1, 1, 1), (32, 1, 1))
    nodes = [
        GraphNode(rig.loaded, one_warp, after=(i - 1,) if i else ()) for i in range(GRAPH_NODES)
    ]
    sets = [
        tuple(
            ([out.bind(), source.bind("read_only")], [p.U32(index + turn)])
            for index in range(GRAPH_NODES)
        )
        for turn, (out, source) in enumerate(((rig.a, rig.b), (spare_a, spare_b)))
    ]
    rows: dict[str, Any] = {}
    name = f"accy backend graph launch, {GRAPH_NODES} nodes, new pointers and scalars each call"
    for how in ("nodes patched by the driver", "arguments through the device table"):
        if how.startswith("arguments"):
            await backend.prepare_graph_kernels([rig.loaded])
        graph = backend.instantiate_graph(nodes)
        turn = [0]

        async def new_arguments(graph: Any = graph, turn: list[int] = turn) -> None:
            for _ in range(GRAPH_LAUNCHES):
                turn[0] += 1
                backend.launch_graph_exec_trusted(graph, sets[turn[0] % 2], stream)

        rows[f"{name}, {how}, per node"] = await paired_us(
            raw, new_arguments, sync, repeat, launches_per_batch=GRAPH_NODES * GRAPH_LAUNCHES
        )
        await sync()
        backend.destroy(graph)
    return rows
