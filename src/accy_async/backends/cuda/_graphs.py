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
from .driver import driver, libcuda

if TYPE_CHECKING:
    from ._device import DeviceState
    from ._launch import Kernel

__all__ = ["CudaGraph", "destroy_graph", "instantiate_graph", "launch_graph"]


class _NodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2``, for ``cuGraphExecKernelNodeSetParams_v2`` through ctypes.

    Patching a node is the per-call cost of a graph with new arguments: called
    through ctypes with this prepared struct it costs a fraction of what
    cuda-python's wrapper (which converts its own struct each call) costs.
    """

    _fields_ = (
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    )


_set_params: Any = None
_graph_launch: Any = None


def _bind_driver_calls() -> None:
    """``cuGraphExecKernelNodeSetParams_v2`` and ``cuGraphLaunch``, typed for ctypes."""
    global _set_params, _graph_launch
    if _set_params is None:
        library = libcuda()
        set_params = library.cuGraphExecKernelNodeSetParams_v2
        set_params.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        set_params.restype = ctypes.c_int
        launch = library.cuGraphLaunch
        launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        launch.restype = ctypes.c_int
        _set_params, _graph_launch = set_params, launch


def _graph_features(total_threads: Any) -> tuple[float, ...]:
    """A graph launch's one feature for the forecast: the threads of all its nodes."""
    return (float(total_threads),)


class _NodeState:
    """One node's argument storage, its prepared params, and the scalars last packed."""

    __slots__ = (
        "address",
        "handle",
        "kernel",
        "last",
        "packer",
        "params",
        "params_address",
        "pointers",
        "scalars",
        "slots",
        "values",
    )

    def __init__(self, kernel: Kernel, handle: Any, slots: Any, pointers: Any) -> None:
        self.kernel = kernel
        self.handle = handle
        self.address = int(handle)
        self.last = b""
        """The arguments as last patched in, packed."""
        self.params_address = 0
        self.slots = slots
        self.pointers = pointers
        self.params: Any = None
        self.scalars: object = None
        self.values: tuple[int | float, ...] = ()
        self.packer: struct.Struct | None = None


class CudaGraph:
    """An instantiated CUDA graph, its template, and each node's argument storage."""

    __slots__ = (
        "cost",
        "exec",
        "exec_address",
        "graph",
        "last_arguments",
        "nodes",
        "stream",
        "stream_address",
        "threads",
    )

    def __init__(self) -> None:
        self.graph: Any = None
        """The graph the executable was made from (kept: its nodes are how updates name them)."""
        self.exec: Any = None
        self.exec_address = 0
        self.nodes: list[_NodeState] = []
        self.last_arguments: object = None
        """The arguments object of the last launch: the same object again patches nothing."""
        self.cost: Any = None
        """The forecast's model of one launch of the whole graph."""
        self.threads = 0
        self.stream: StreamHandle | None = None
        """The stream of the last launch, and its ``CUstream`` as an address."""
        self.stream_address = 0


def instantiate_graph(device: DeviceState, nodes: Sequence[GraphNode]) -> CudaGraph:
    """Build and instantiate a graph of ``nodes``; nothing is left behind on failure."""
    built = CudaGraph()
    with device.bound():  # the graph and its instance are made in the backend's context
        _build(device, built, nodes)
    built.exec_address = int(built.exec)
    built.cost = device.forecast.model(
        ("graph", id(built)), f"graph of {len(nodes)} nodes", _graph_features
    )
    _bind_driver_calls()
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
    """Patch every node with its arguments (unless they are the last launch's), then launch."""
    built: CudaGraph = graph.native
    if arguments is not built.last_arguments:
        built.last_arguments = None  # until every node is patched
        set_params = _set_params
        exec_address = built.exec_address
        resolved: dict[tuple[int, int], tuple[tuple[int | float, ...], struct.Struct]] = {}
        for state, (buffers, scalars) in zip(built.nodes, arguments, strict=True):
            if scalars is not state.scalars:
                # Nodes often share one scalars object: its values and packer are read once.
                key = (id(scalars), len(buffers))
                known = resolved.get(key)
                if known is None:
                    known = resolved[key] = (
                        tuple([argument.value for argument in scalars]),
                        state.kernel.packer(
                            len(buffers), tuple([argument.type_name for argument in scalars])
                        ),
                    )
                state.scalars = scalars
                state.values, state.packer = known
            packer = state.packer
            assert packer is not None
            packed = packer.pack(*[binding.address for binding in buffers], *state.values)
            if packed != state.last:  # a node whose arguments did not change is not patched
                ctypes.memmove(state.slots, packed, len(packed))
                result = set_params(exec_address, state.address, state.params_address)
                if result:
                    device.fail(result, "updating a graph's node")
                state.last = packed
        built.last_arguments = arguments
    for event in wait_events:
        device.wait(stream, event)
    if stream is not built.stream:
        built.stream, built.stream_address = stream, int(stream.native)
    result = _graph_launch(built.exec_address, built.stream_address)
    if result:
        device.fail(result, "launching a graph")
    device.ledgers[stream.id].enqueue(built.cost, built.threads)
    if signal_event is not None:
        device.record(signal_event, stream)


def _build(device: DeviceState, built: CudaGraph, nodes: Sequence[GraphNode]) -> None:
    """Create ``built``'s graph of ``nodes`` and instantiate it (destroyed again on failure)."""
    d = driver()
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
            dims = node.config.dims
            (
                params.gridDimX,
                params.gridDimY,
                params.gridDimZ,
                params.blockDimX,
                params.blockDimY,
                params.blockDimZ,
                params.sharedMemBytes,
            ) = dims
            params.kernelParams = ctypes.addressof(pointers)
            dependencies = [built.nodes[before].handle for before in node.after]
            handle = device.value(
                d.cuGraphAddKernelNode(graph, dependencies, len(dependencies), params),
                f"adding {node.loaded.artifact.spec.kernel_name} to a graph",
            )
            state = _NodeState(kernel, handle, slots, pointers)
            state.params = _NodeParams(
                int(kernel.function), *dims, ctypes.addressof(pointers), None, None, None
            )
            state.params_address = ctypes.addressof(state.params)
            built.nodes.append(state)
            built.threads += dims[0] * dims[1] * dims[2] * dims[3] * dims[4] * dims[5]
        built.exec = device.value(d.cuGraphInstantiate(graph, 0), "instantiating a graph")
    except BaseException:
        d.cuGraphDestroy(graph)
        raise
