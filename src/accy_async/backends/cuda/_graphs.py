"""CUDA graphs of kernel nodes: built and instantiated once, patched and launched per call.

A graph is built with explicit kernel nodes (``cuGraphAddKernelNode``, its
dependencies as edges) and instantiated (``cuGraphInstantiate``); the graph
is kept beside the executable (its node handles name the nodes to patch) until
both are destroyed together.

A node whose kernel has an argument-table variant (made by
:meth:`~accy_async.backends.Backend.prepare_graph_kernels`, see
:mod:`._table_ptx`) runs the variant, whose one fixed argument is where its
arguments lie in the graph's device table. A launch with new arguments packs
every such node's arguments into a host copy of the table and copies it to
the device on the launch's stream, before the graph: one
``cuMemcpyHtoDAsync`` from pageable memory, which the driver stages at the
call for a table this small, so the host copy is reused at once (on the H200,
64 B to 64 KiB behind a busy stream: the call returned in 10-14 µs and the
device saw the bytes as they were at the call; the driver documents that it
may synchronize with the stream instead, which would still be correct, only
slower). Launches of one graph run in order, but the copy is not part of the
graph: each launch records an event after it, and a launch on another stream
than the last waits (on the device) for that event before rewriting the table.

Other nodes are patched through the driver, each whose packed arguments
changed since the last launch (``cuGraphExecKernelNodeSetParams``, about a
launch's host cost). The whole graph goes as one submission
(``cuGraphLaunch``). Nothing is allocated inside a graph; the table is
allocated with it and freed with it.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._graph_exec import GraphExec, GraphNode, NodeArguments
from .._handles import EventHandle, StreamHandle
from ._launch import TableKernel, argument_format
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

_TABLE_ALIGNMENT = 16


def _bind_driver_calls() -> None:
    """``cuGraphExecKernelNodeSetParams``, typed for ctypes.

    cuda-python would build its struct anew each call; the graph's other
    calls cost less through cuda-python (measured on the H200).
    """
    global _set_params
    if _set_params is None:
        set_params = libcuda().cuGraphExecKernelNodeSetParams_v2
        set_params.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        set_params.restype = ctypes.c_int
        _set_params = set_params


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
        "table_bytes",
        "table_offset",
        "values",
    )

    def __init__(self, kernel: Kernel, handle: Any, slots: Any, pointers: Any) -> None:
        self.kernel = kernel
        self.table_offset = -1
        """Where the node's arguments lie in the graph's table; -1: patched by the driver."""
        self.table_bytes = 0
        """The bytes the node has there (its arguments' slots, padded to keep the next aligned)."""
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
        "order",
        "order_ledger",
        "order_position",
        "staging",
        "staging_address",
        "stream",
        "table",
        "table_native",
        "table_only",
        "table_packer",
        "table_size",
        "table_types",
        "threads",
    )

    def __init__(self) -> None:
        self.table = 0
        """The device table of the table nodes' arguments (0: no table nodes)."""
        self.table_native: Any = None
        """The table's ``CUdeviceptr``, as the driver calls take it."""
        self.table_size = 0
        self.table_only = False
        """Whether every node reads the table (packed in one go, see :func:`_pack_table`)."""
        self.table_packer: struct.Struct | None = None
        self.table_types: list[str] | None = None
        """The scalar types ``table_packer`` was made for, node after node."""
        self.staging: Any = None
        """The table's host copy, packed by each launch with new arguments."""
        self.staging_address = 0
        self.order: Any = None
        """Recorded after each launch (with a table): a launch on another stream waits for it
        before rewriting the table (the last stream may be gone by then)."""
        self.order_ledger: Any = None
        """The ledger and position of ``order``'s last record (``None``: not recorded)."""
        self.order_position = 0
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
        """The stream of the last launch."""


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


def destroy_graph(built: CudaGraph) -> Any:
    """Destroy the executable, its graph, table and event (on the janitor's thread).

    The table is freed once the last launch that reads it has ended (its end
    event waited for here); the executable the driver releases when its
    launches complete.

    The driver's result: the first that failed, else the last.
    """
    d = driver()
    results = [d.cuGraphExecDestroy(built.exec), d.cuGraphDestroy(built.graph)]
    if built.table:  # freed once the last launch that reads it has ended
        results += [
            d.cuEventSynchronize(built.order),
            d.cuEventDestroy(built.order),
            d.cuMemFree(built.table_native),
        ]
    return next((result for result in results if int(result[0])), results[-1])


def launch_graph(
    device: DeviceState,
    graph: GraphExec,
    arguments: Sequence[NodeArguments],
    stream: StreamHandle,
    wait_events: Sequence[EventHandle],
    signal_event: EventHandle | None,
) -> None:
    """Put every node's arguments in (unless they are the last launch's), then launch."""
    built: CudaGraph = graph.native
    for event in wait_events:
        device.wait(stream, event)
    d = driver()
    native = stream.native
    if stream is not built.stream:
        if built.order_ledger is not None:
            # The table is rewritten on this stream: after the last launch has read it.
            _follow(device, built, stream)
        built.stream = stream
    if arguments is not built.last_arguments:
        built.last_arguments = None  # until every node is put in
        if built.table_only:
            _pack_table(built, arguments)
        else:
            _patch_nodes(device, built, arguments)
        if built.table:
            (result,) = d.cuMemcpyHtoDAsync(
                built.table_native, built.staging_address, built.table_size, native
            )
            if result:
                device.fail(result, "copying a graph's argument table")
        built.last_arguments = arguments
    (result,) = d.cuGraphLaunch(built.exec, native)
    if result:
        device.fail(result, "launching a graph")
    ledger = device.ledgers[stream.id]
    ledger.enqueue(built.cost, built.threads)
    if built.table:  # where the last launch reading the table ends (its stream may go)
        (result,) = d.cuEventRecord(built.order, native)
        if result:
            device.fail(result, "recording a graph's end")
        built.order_ledger, built.order_position = ledger, ledger.position
    if signal_event is not None:
        device.record(signal_event, stream)


def _pack_table(built: CudaGraph, arguments: Sequence[NodeArguments]) -> None:
    """Pack every node's arguments into the table's host copy.

    Nodes often share argument objects (a launch graph's nodes are launches of
    a few distinct kinds): when at most half of them are distinct, each
    distinct one is packed once and the table joined from those
    (:func:`_join_shared`). Otherwise one pack for the whole table, its format
    following the scalars' types, made again when they change (node by node,
    the counts of buffers and scalars are the kernels').
    """
    order = list(map(id, arguments))
    distinct = dict(zip(order, arguments, strict=True))
    if 2 * len(distinct) <= len(order):
        _join_shared(built, distinct, order)
        return
    values: list[int | float] = []
    names: list[str] = []
    add_value, add_name = values.append, names.append
    for buffers, scalars in arguments:  # plain loops: a map per node costs more than its items
        for binding in buffers:
            add_value(binding.address)
        for scalar in scalars:
            add_value(scalar.value)
            add_name(scalar.type_name)
    if names != built.table_types:
        codes = []
        for state, (buffers, scalars) in zip(built.nodes, arguments, strict=True):
            node = argument_format(len(buffers), [argument.type_name for argument in scalars])
            codes += [node, "x" * (state.table_bytes - struct.calcsize("<" + node))]
        built.table_packer = struct.Struct("<" + "".join(codes))
        built.table_types = names
    packer = built.table_packer
    assert packer is not None
    packer.pack_into(built.staging, 0, *values)


def _join_shared(built: CudaGraph, distinct: dict[int, NodeArguments], order: list[int]) -> None:
    """The table from each distinct argument object packed once, in the nodes' order."""
    packed = {}
    for key, (buffers, scalars) in distinct.items():
        packer = _node_packer(len(buffers), tuple([scalar.type_name for scalar in scalars]))
        packed[key] = packer.pack(
            *[binding.address for binding in buffers], *[scalar.value for scalar in scalars]
        )
    table = b"".join(map(packed.__getitem__, order))
    if len(table) != built.table_size:  # the trusted caller's counts are the kernels'
        raise AssertionError("graph arguments do not fit the graph's argument table")
    ctypes.memmove(built.staging, table, len(table))


_node_packers: dict[tuple[int, tuple[str, ...]], struct.Struct] = {}


def _node_packer(buffer_count: int, scalar_types: tuple[str, ...]) -> struct.Struct:
    """One node's arguments as the table holds them: 8-byte slots, padded to the alignment."""
    key = (buffer_count, scalar_types)
    packer = _node_packers.get(key)
    if packer is None:
        node = "<" + argument_format(buffer_count, scalar_types)
        packer = _node_packers[key] = struct.Struct(
            node + "x" * (_table_bytes(buffer_count + len(scalar_types)) - struct.calcsize(node))
        )
    return packer


def _patch_nodes(device: DeviceState, built: CudaGraph, arguments: Sequence[NodeArguments]) -> None:
    """Node by node: pack a table node's arguments into the table, patch any other's."""
    set_params = _set_params
    exec_address = built.exec_address
    staging = built.staging
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
        if state.table_offset >= 0:
            addresses = [binding.address for binding in buffers]
            packer.pack_into(staging, state.table_offset, *addresses, *state.values)
            continue
        packed = packer.pack(*[binding.address for binding in buffers], *state.values)
        if packed != state.last:  # a node whose arguments did not change is not patched
            ctypes.memmove(state.slots, packed, len(packed))
            result = set_params(exec_address, state.address, state.params_address)
            if result:
                device.fail(result, "updating a graph's node")
            state.last = packed


def _follow(device: DeviceState, built: CudaGraph, stream: StreamHandle) -> None:
    """``stream`` waits, on the device, for the end of ``built``'s last launch."""
    (result,) = driver().cuStreamWaitEvent(stream.native, built.order, 0)
    if result:
        device.fail(result, "ordering a graph's launches")
    assert built.order_ledger is not None
    device.ledgers[stream.id].enqueue_wait(built.order_ledger, built.order_position)


def _build(device: DeviceState, built: CudaGraph, nodes: Sequence[GraphNode]) -> None:
    """Create ``built``'s graph of ``nodes`` and instantiate it (all undone on failure)."""
    d = driver()
    places, built.table_size = _table_places(nodes)
    built.table_only = all(offset >= 0 for offset, _ in places)
    try:
        if built.table_size:
            built.table = device.allocate(built.table_size, "allocating a graph's argument table")
            built.table_native = d.CUdeviceptr(built.table)
            built.order = device.value(
                d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "creating an event"
            )
            built.staging = ctypes.create_string_buffer(built.table_size)
            built.staging_address = ctypes.addressof(built.staging)
        built.graph = device.value(d.cuGraphCreate(0), "creating a graph")
        for node, place in zip(nodes, places, strict=True):
            _add_node(device, built, node, place)
        built.exec = device.value(d.cuGraphInstantiate(built.graph, 0), "instantiating a graph")
    except BaseException:
        if built.graph is not None:
            d.cuGraphDestroy(built.graph)
        if built.order is not None:
            d.cuEventDestroy(built.order)
        if built.table:
            d.cuMemFree(built.table_native)
        raise


def _table_places(nodes: Sequence[GraphNode]) -> tuple[list[tuple[int, int]], int]:
    """Each node's ``(offset, bytes)`` in the argument table (-1, 0: patched), and its size."""
    places = []
    size = 0
    for node in nodes:
        kernel: Kernel = node.loaded.native
        if isinstance(kernel.table, TableKernel):
            taken = _table_bytes(kernel.argument_count)
            places.append((size, taken))
            size += taken
        else:
            places.append((-1, 0))
    return places, size


def _table_bytes(argument_count: int) -> int:
    """The bytes a node of ``argument_count`` arguments takes in the table (aligned)."""
    return -(-8 * max(argument_count, 1) // _TABLE_ALIGNMENT) * _TABLE_ALIGNMENT


def _add_node(
    device: DeviceState, built: CudaGraph, node: GraphNode, place: tuple[int, int]
) -> None:
    """Add ``node`` after its dependencies: its table variant at ``place``, or the kernel."""
    offset = place[0]
    d = driver()
    kernel: Kernel = node.loaded.native
    count = max(kernel.argument_count, 1)
    slots = ctypes.create_string_buffer(8 * count)
    base = ctypes.addressof(slots)
    pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
    params = d.CUDA_KERNEL_NODE_PARAMS()
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
    if offset >= 0:
        assert isinstance(kernel.table, TableKernel)
        params.func = kernel.table.function
        ctypes.c_uint64.from_buffer(slots).value = built.table + offset  # its one argument
    else:
        params.func = kernel.function
    params.kernelParams = ctypes.addressof(pointers)
    dependencies = [built.nodes[before].handle for before in node.after]
    handle = device.value(
        d.cuGraphAddKernelNode(built.graph, dependencies, len(dependencies), params),
        f"adding {node.loaded.artifact.spec.kernel_name} to a graph",
    )
    state = _NodeState(kernel, handle, slots, pointers)
    state.table_offset, state.table_bytes = place
    state.params = _NodeParams(
        int(params.func), *dims, ctypes.addressof(pointers), None, None, None
    )
    state.params_address = ctypes.addressof(state.params)
    built.nodes.append(state)
    built.threads += dims[0] * dims[1] * dims[2] * dims[3] * dims[4] * dims[5]
