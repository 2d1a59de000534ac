"""CUDA graphs of kernel nodes: built and instantiated once, patched and launched per call.

A graph is built with explicit kernel nodes (``cuGraphAddKernelNode``, its
dependencies as edges) and instantiated (``cuGraphInstantiate``); the graph
is kept beside the executable (its node handles name the nodes to patch) until
both are destroyed together. Each launch packs every
node's arguments into the node's own argument array and patches only the
nodes whose packed arguments changed since the last launch
(``cuGraphExecKernelNodeSetParams``, which copies them and affects later
launches only), then launches the whole graph as one submission
(``cuGraphLaunch``). Nothing is allocated inside a graph.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._graph_exec import GraphExec, GraphNode, NodeArguments
from .._handles import EventHandle, StreamHandle
from .driver import driver

if TYPE_CHECKING:
    from ._device import DeviceState
    from ._launch import Kernel

__all__ = ["CudaGraph", "destroy_graph", "instantiate_graph", "launch_graph"]


class CudaGraph:
    """An instantiated CUDA graph and, per node, its argument storage and last arguments."""

    __slots__ = (
        "exec",
        "graph",
        "handles",
        "kernels",
        "last",
        "last_arguments",
        "last_values",
        "params",
        "pointers",
        "slots",
    )

    def __init__(self) -> None:
        self.graph: Any = None
        """The graph the executable was made from: its nodes are how updates name them."""
        self.exec: Any = None
        self.handles: list[Any] = []
        self.kernels: list[Kernel] = []
        self.params: list[Any] = []
        self.slots: list[Any] = []
        self.pointers: list[Any] = []
        self.last: list[bytes | None] = []
        """Each node's packed arguments as last patched in (``None``: never)."""
        self.last_arguments: object = None
        """The arguments object of the last launch: the same object again patches nothing."""
        self.last_values: list[tuple[int | float, ...]] = []


def instantiate_graph(device: DeviceState, nodes: Sequence[GraphNode]) -> CudaGraph:
    """Build and instantiate a graph of ``nodes``; nothing is left behind on failure."""
    d = driver()
    built = CudaGraph()
    graph = built.graph = device.value(d.cuGraphCreate(0), "creating a graph")
    try:
        for node in nodes:
            kernel: Kernel = node.loaded.native
            count = max(kernel.argument_count, 1)
            slots = ctypes.create_string_buffer(8 * count)
            base = ctypes.addressof(slots)
            pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
            params = d.CUDA_KERNEL_NODE_PARAMS()
            params.func = kernel.function
            (
                params.gridDimX,
                params.gridDimY,
                params.gridDimZ,
                params.blockDimX,
                params.blockDimY,
                params.blockDimZ,
                params.sharedMemBytes,
            ) = node.config.dims
            params.kernelParams = ctypes.addressof(pointers)
            dependencies = [built.handles[before] for before in node.after]
            handle = device.value(
                d.cuGraphAddKernelNode(graph, dependencies, len(dependencies), params),
                f"adding {node.loaded.artifact.spec.kernel_name} to a graph",
            )
            built.handles.append(handle)
            built.kernels.append(kernel)
            built.params.append(params)
            built.slots.append(slots)
            built.pointers.append(pointers)
            built.last.append(None)
        built.exec = device.value(d.cuGraphInstantiate(graph, 0), "instantiating a graph")
    except BaseException:
        d.cuGraphDestroy(graph)
        raise
    return built


def destroy_graph(built: CudaGraph) -> None:
    """Destroy the executable, then its graph (on the janitor's thread: it may synchronize)."""
    d = driver()
    d.cuGraphExecDestroy(built.exec)
    d.cuGraphDestroy(built.graph)


def launch_graph(
    device: DeviceState,
    graph: GraphExec,
    arguments: Sequence[NodeArguments],
    stream: StreamHandle,
    wait_events: Sequence[EventHandle],
    signal_event: EventHandle | None,
) -> None:
    """Patch the nodes whose arguments changed, then launch the graph on ``stream``."""
    built: CudaGraph = graph.native
    d = driver()
    if arguments is built.last_arguments:  # a relaunch of the very same arguments
        _submit(device, graph, built, stream, wait_events, signal_event)
        return
    built.last_arguments = None  # until every node is patched
    values_of = built.last_values = []
    for index, (buffers, scalars) in enumerate(arguments):
        kernel = built.kernels[index]
        values = tuple([argument.value for argument in scalars])
        values_of.append(values)
        packer: struct.Struct = kernel.packer(
            len(buffers), tuple([argument.type_name for argument in scalars])
        )
        packed = packer.pack(*[binding.address for binding in buffers], *values)
        if packed != built.last[index]:
            ctypes.memmove(built.slots[index], packed, len(packed))
            device.check(
                d.cuGraphExecKernelNodeSetParams(
                    built.exec, built.handles[index], built.params[index]
                ),
                "updating a graph's node",
            )
            built.last[index] = packed
    built.last_arguments = arguments
    _submit(device, graph, built, stream, wait_events, signal_event)


def _submit(
    device: DeviceState,
    graph: GraphExec,
    built: CudaGraph,
    stream: StreamHandle,
    wait_events: Sequence[EventHandle],
    signal_event: EventHandle | None,
) -> None:
    d = driver()
    for event in wait_events:
        device.wait(stream, event)
    (result,) = d.cuGraphLaunch(built.exec, stream.native)
    if int(result):
        device.fail(result, "launching a graph")
    ledger = device.ledgers[stream.id]
    for node, kernel, values in zip(graph.nodes, built.kernels, built.last_values, strict=True):
        ledger.enqueue(kernel.cost, (node.config.grid, node.config.block, values))
    if signal_event is not None:
        device.record(signal_event, stream)
