"""The async launch-graph runner: every node an awaitable step over the device.

:func:`launch_graph` turns a :class:`~accy_async.plan.LaunchGraphPlan` into
enqueued work and returns a :class:`GraphRun` as soon as everything is
enqueued, without waiting for the device:

* **host order** (no dependency crosses streams): nodes are enqueued in list
  order, loops repeat their nodes ``trip_count`` times with carried slots
  ping-ponging between two buffers;
* **dependency events** (some dependency crosses streams): nodes are enqueued
  in list order, each on its own stream. Dependencies point forward, so by a
  node's turn its producers on other streams have recorded their dependency
  events; the node enqueues its launch with device-side waits on them
  (``cuStreamWaitEvent`` on CUDA), then records its own event if a node on
  another stream consumes it (one event per such producer, not per edge).
  The host never waits for the device: the streams overlap on the device as
  far as the dependencies allow.

Errors: the first error stops enqueueing and is raised as itself, after the
work already enqueued has been awaited (shielded from cancellation, bounded)
and the run's own events and streams have been destroyed exactly once; later
nodes are never enqueued, so there is never more than one error to report.
Cancellation does the same and re-raises the cancellation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import anyio
import msgspec

from ._cache import IdentityCache
from ._loops import admit, checkpoint
from .backends import Backend, BufferBinding, DeviceObject, EventHandle, StreamHandle, StreamLike
from .backends import GraphNode as BackendGraphNode
from .errors import InvalidArtifact, InvalidBuffer, LaunchArgumentMismatch, UnsupportedOperation
from .kernels import (
    ElementCountBufferBinding,
    LaunchOptions,
    LoadedKernels,
    PreparedLaunch,
    SlotBinding,
    slot_map,
)
from .plan import (
    ArtifactPlan,
    GraphDependency,
    GraphLoop,
    GraphNode,
    LaunchGraphPlan,
    create_dataflow_launch_graph_plan,
    validate_plan,
)
from .waiting import CompletionLatch, release_when_idle, wait_event

__all__ = ["GraphRun", "NodeCompletion", "launch_all", "launch_graph"]

_YIELD_EVERY: Final = 256
"""Enqueues between checkpoints, so a large graph never holds the event loop for long."""


class NodeCompletion:
    """Awaitable completion of one node of a :class:`GraphRun`.

    It completes when the earliest marker recorded on the node's stream at or
    after the node has: the node's own dependency event if it has one, else
    that of the next producer on its stream, else the stream's end of the
    run. For a node inside a loop, that is its last iteration.
    """

    __slots__ = ("_backend", "_event", "_tail", "index")

    def __init__(
        self,
        index: int,
        backend: Backend,
        event: EventHandle | None,
        tail: CompletionLatch,
    ) -> None:
        self.index = index
        self._backend = backend
        self._event = event
        self._tail = tail

    @property
    def done(self) -> bool:
        """Whether the node is known to have completed."""
        if self._tail.done:
            return True
        return self._event is not None and self._backend.query_event(self._event)

    async def wait(self) -> None:
        """Return once the node has completed on the device."""
        # The run's events are released only after every stream of the run has
        # finished, so while this node's stream has not, its event is alive.
        if self._event is None or self._tail.done:
            await self._tail.wait()
        else:
            await wait_event(self._backend, self._event)


class GraphRun:
    """A launched graph: everything is enqueued; await the whole or any node.

    The run owns nothing that needs closing: its dependency events and the
    streams it created are released by the backend once the device has
    finished with them.
    """

    __slots__ = ("_backend", "_events", "_node_tails", "_schedule", "_tails", "enqueued_launches")

    def __init__(
        self,
        backend: Backend | None = None,
        schedule: _Schedule | None = None,
        tails: Sequence[CompletionLatch] = (),
        node_tails: Sequence[CompletionLatch] = (),
        events: Mapping[int, EventHandle] | None = None,
        enqueued_launches: int = 0,
    ) -> None:
        self._backend = backend
        self._schedule = schedule
        self._tails = tuple(tails)
        self._node_tails = tuple(node_tails)
        self._events = events or {}
        self.enqueued_launches = enqueued_launches
        """How many kernel launches the run enqueued (loops counted per iteration)."""

    @property
    def done(self) -> bool:
        """Whether every stream of the run is known to have finished."""
        return all(latch.done for latch in self._tails)

    async def wait(self) -> None:
        """Return once all the run's work has completed on the device (a checkpoint)."""
        if not self._tails:
            await checkpoint()
        for latch in self._tails:
            await latch.wait()

    def node(self, index: int) -> NodeCompletion:
        """The completion of node ``index``."""
        if self._backend is None or self._schedule is None:
            raise IndexError(f"node {index} does not exist: the run has no nodes")
        producer = self._schedule.completion_producer[index]
        event = self._events.get(producer) if producer >= 0 else None
        return NodeCompletion(index, self._backend, event, self._node_tails[index])

    async def __aenter__(self) -> GraphRun:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=exc_info[0] is not None):
            await self.wait()


@dataclass(frozen=True, slots=True, eq=False)
class _Schedule:
    """What a graph needs at launch time, derived once per (graph, plan)."""

    graph: LaunchGraphPlan
    plan: ArtifactPlan
    uses_events: bool
    variants: tuple[tuple[int, GraphNode], ...]
    """Distinct ``(kernel_index, node)`` launches; nodes index them by ``node_variant``."""
    node_variant: tuple[int, ...]
    producers: tuple[int, ...]
    """Nodes that record a dependency event (each has a consumer on another stream)."""
    cross_waits: tuple[tuple[int, ...], ...]
    """Per node, the producers on other streams it waits for."""
    loop_at: Mapping[int, GraphLoop]
    completion_producer: tuple[int, ...]
    """Per node, the first producer at or after it on its stream (-1: the stream's end)."""
    unrolled: tuple[tuple[int, int], ...]
    """The launches in enqueue order as ``(node index, iteration)`` (-1 outside loops)."""
    unrolled_after: tuple[tuple[int, ...], ...]
    """Per launch of ``unrolled``, the earlier launches it follows: its stream's previous
    one, and its producers on other streams (as graph edges)."""
    graph_refusal: str | None
    """Why the graph cannot run as one device graph (``None``: it can)."""


_schedules: IdentityCache[_Schedule] = IdentityCache(64)


def _schedule(graph: LaunchGraphPlan, plan: ArtifactPlan) -> _Schedule:
    cached = _schedules.get((graph, plan))
    if cached is not None:
        return cached
    validate_plan(graph)
    graph.validate(plan)
    nodes = graph.nodes
    variant_index: dict[tuple[object, ...], int] = {}
    variants: list[tuple[int, GraphNode]] = []
    node_variant = []
    for node in nodes:
        key_of_node = (node.kernel_index, node.tuning, node.runtime_scalar_arguments)
        index = variant_index.get(key_of_node)
        if index is None:
            index = variant_index[key_of_node] = len(variants)
            variants.append((node.kernel_index, node))
        node_variant.append(index)
    uses_events = graph.needs_dependency_events()
    producers: set[int] = set()
    cross: list[list[int]] = [[] for _ in nodes]
    if uses_events:
        for dependency in graph.dependencies:
            if _crosses_streams(nodes, dependency):
                producers.add(dependency.producer_node_index)
                cross[dependency.consumer_node_index].append(dependency.producer_node_index)
    completion_producer = [-1] * len(nodes)
    following: dict[int | None, int] = {}
    for index in range(len(nodes) - 1, -1, -1):
        if index in producers:
            following[nodes[index].stream] = index
        completion_producer[index] = following.get(nodes[index].stream, -1)
    unrolled, unrolled_after = _unroll(graph, uses_events, cross)
    refusal = None
    if any(node.wait_events or node.signal_event is not None for node in nodes):
        refusal = "its nodes wait for or signal the caller's events"
    schedule = _Schedule(
        graph=graph,
        plan=plan,
        uses_events=uses_events,
        variants=tuple(variants),
        node_variant=tuple(node_variant),
        producers=tuple(sorted(producers)),
        cross_waits=tuple(tuple(sorted(set(waits))) for waits in cross),
        loop_at={loop.first_node_index: loop for loop in graph.loops},
        completion_producer=tuple(completion_producer),
        unrolled=unrolled,
        unrolled_after=unrolled_after,
        graph_refusal=refusal,
    )
    return _schedules.put((graph, plan), schedule)


def _unroll(
    graph: LaunchGraphPlan, uses_events: bool, cross: Sequence[Sequence[int]]
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, ...], ...]]:
    """Every launch the eager runner enqueues, in its order, with what each follows.

    Host order repeats a loop's nodes ``trip_count`` times; with dependency
    events every node runs once (as :meth:`_Run.enqueue_with_events` does).
    """
    nodes = graph.nodes
    order: list[tuple[int, int]] = []
    after: list[tuple[int, ...]] = []
    last_on_stream: dict[int | None, int] = {}
    last_of: dict[int, int] = {}

    def add(index: int, iteration: int) -> None:
        follows = set()
        stream = nodes[index].stream
        if stream in last_on_stream:
            follows.add(last_on_stream[stream])
        for producer in cross[index]:
            follows.add(last_of[producer])
        last_on_stream[stream] = last_of[index] = len(order)
        order.append((index, iteration))
        after.append(tuple(sorted(follows)))

    if uses_events:
        for index in range(len(nodes)):
            add(index, -1)
        return tuple(order), tuple(after)
    loop_at = {loop.first_node_index: loop for loop in graph.loops}
    index = 0
    while index < len(nodes):
        loop = loop_at.get(index)
        if loop is None:
            add(index, -1)
            index += 1
            continue
        for iteration in range(loop.trip_count):
            for member in range(loop.first_node_index, loop.first_node_index + loop.node_count):
                add(member, iteration)
        index += loop.node_count
    return tuple(order), tuple(after)


def _crosses_streams(nodes: Sequence[GraphNode], dependency: GraphDependency) -> bool:
    return (
        nodes[dependency.producer_node_index].stream != nodes[dependency.consumer_node_index].stream
    )


async def launch_graph(
    kernels: LoadedKernels,
    slot_bindings: Sequence[SlotBinding] | Mapping[int, BufferBinding],
    graph: LaunchGraphPlan,
    element_count_buffers: Sequence[ElementCountBufferBinding] = (),
    *,
    streams: Sequence[StreamLike] | None = None,
    events: Sequence[EventHandle] = (),
    default_stream: StreamLike | None = None,
    device_graph: bool | None = None,
) -> GraphRun:
    """Enqueue every node of ``graph`` and return once all are enqueued.

    ``streams`` bind the graph's stream indices (the run creates
    ``graph.stream_count`` streams when none are given, and releases them
    after); ``events`` bind its event indices; nodes with no stream go to
    ``default_stream`` (the backend's when ``None``). Streams may be other
    libraries' (see :meth:`~accy_async.backends.base.Backend.adopt_stream`). The returned
    :class:`GraphRun` awaits the whole graph or any node. See the module
    docstring for how errors and cancellation are handled.

    ``device_graph`` chooses whether every launch goes to the device as one
    graph (see :meth:`~accy_async.backends.Backend.instantiate_graph`): its
    nodes' dependencies are the graph's edges (a node follows the previous
    node of its stream and its producers on other streams), loops unrolled;
    the graph is instantiated once per launch graph and kept by ``kernels``,
    and each run patches in its buffers. It runs on the stream of the first
    node; the run's other streams wait (on the device) for its end, so every
    stream and node completes as it would otherwise (a node, no earlier
    than the graph's end). ``None`` (the default) decides: a launch graph of
    two or more launches, launched through these kernels before, goes as one
    graph where it can (not when its nodes wait for or signal the caller's
    events, or a kernel fills scratch first; then node by node). ``True``
    insists (:class:`~accy_async.errors.UnsupportedOperation` where it
    cannot); ``False`` never.
    """
    await admit()
    plan = kernels.artifact_plan
    if kernels.kernel_count != len(plan.kernels):
        raise InvalidArtifact("the loaded kernels do not match their artifact plan")
    schedule = _schedule(graph, plan)
    if len(events) < graph.event_count:
        raise LaunchArgumentMismatch(
            f"the graph uses {graph.event_count} events, {len(events)} were given"
        )
    if streams is not None and len(streams) < graph.stream_count:
        raise LaunchArgumentMismatch(
            f"the graph uses {graph.stream_count} streams, {len(streams)} were given"
        )
    backend = kernels.backend
    as_graph = device_graph is True or (
        device_graph is None
        and kernels.launched_before(schedule)
        and len(schedule.unrolled) > 1
        and schedule.graph_refusal is None
    )
    if device_graph is True and schedule.graph_refusal is not None:
        raise UnsupportedOperation(
            f"this launch graph cannot run as one device graph: {schedule.graph_refusal}"
        )
    slots = slot_bindings if isinstance(slot_bindings, Mapping) else slot_map(slot_bindings)
    counts = {entry.kernel_id: entry.binding for entry in element_count_buffers}
    prepared = [
        kernels.prepare_launch(
            kernel_index,
            slots,
            counts.get(kernels.kernel_ids[kernel_index]),
            tuning=node.tuning,
            runtime_scalar_arguments=node.runtime_scalar_arguments,
            pack=not as_graph,
        )
        for kernel_index, node in schedule.variants
    ]
    for each in prepared:
        kernels.check_live(each)
    for event in events:
        if not backend.owns(event):
            raise InvalidBuffer(f"{event!r} is not a live event of this backend")
    stream_handles = [backend.adopt_stream(stream) for stream in streams or ()]
    default = None if default_stream is None else backend.adopt_stream(default_stream)
    owned: list[DeviceObject] = []
    run: _Run | None = None
    try:
        while len(stream_handles) < graph.stream_count:
            stream_handles.append(backend.create_stream())
            owned.append(stream_handles[-1])
        run = _Run(
            kernels,
            schedule,
            prepared,
            slots,
            counts,
            stream_handles,
            events,
            default,
            owned,
        )
        if as_graph and run.enqueue_as_device_graph(device_graph):
            await checkpoint()
        elif schedule.uses_events:
            run.pack()
            await run.enqueue_with_events()
        else:
            run.pack()
            await run.enqueue_host_order()
        result = run.finish()
    except BaseException:
        used = run.used_streams if run is not None else [default]
        await release_when_idle(backend, owned, used)
        raise
    backend.defer_destroy(owned, after=run.used_streams)
    return result


class _Run:
    """One launch of a graph: the enqueue loops and what they produce."""

    def __init__(
        self,
        kernels: LoadedKernels,
        schedule: _Schedule,
        prepared: list[PreparedLaunch],
        slots: Mapping[int, BufferBinding],
        counts: Mapping[int, BufferBinding],
        stream_handles: Sequence[StreamHandle],
        events: Sequence[EventHandle],
        default_stream: StreamHandle | None,
        owned: list[DeviceObject],
    ) -> None:
        self.kernels = kernels
        self.backend: Backend = kernels.backend
        self.schedule = schedule
        self.prepared = prepared
        self.slots = slots
        self.counts = counts
        self.events = events
        self.owned = owned
        graph = schedule.graph
        default = default_stream
        self.node_streams: list[StreamHandle | None] = [
            default if node.stream is None else stream_handles[node.stream] for node in graph.nodes
        ]
        self.used_streams: list[StreamHandle | None] = list(
            {id(s): s for s in self.node_streams}.values()
        )
        self.dependency_events: dict[int, EventHandle] = {}
        self.launches = 0

    # ----- one device graph ----------------------------------------------------------------

    def enqueue_as_device_graph(self, wanted: bool | None) -> bool:
        """Enqueue the whole run as one device graph.

        ``False`` (nothing enqueued, every launch packed for the eager path)
        where it cannot be one and ``wanted`` is not ``True``.
        """
        schedule = self.schedule
        loops = {loop.first_node_index: loop for loop in schedule.graph.loops if loop.carries}
        loop_of: dict[int, GraphLoop] = {}
        for loop in loops.values():
            for member in range(loop.first_node_index, loop.first_node_index + loop.node_count):
                loop_of[member] = loop
        variants = {first: self._loop_variants(loop, pack=False) for first, loop in loops.items()}
        launches: list[PreparedLaunch] = []
        for index, iteration in schedule.unrolled:
            carrying = loop_of.get(index)
            if carrying is not None and iteration >= 0:
                prepared = variants[carrying.first_node_index][iteration % 2]
                launches.append(prepared[index - carrying.first_node_index])
            else:
                launches.append(self.prepared[schedule.node_variant[index]])
        if any(prepared.fills for prepared in launches):
            if wanted is True:
                raise UnsupportedOperation(
                    "this launch graph cannot run as one device graph: a kernel fills scratch"
                )
            self.pack()
            return False
        kernels = self.kernels
        after = schedule.unrolled_after
        graph = kernels.device_graphs.get(
            schedule,
            lambda: [
                BackendGraphNode(prepared.loaded, prepared.config, after=after[position])
                for position, prepared in enumerate(launches)
            ],
            lambda: kernels.streams_used,
            wanted=wanted,
            what="the launch graph",
        )
        if graph is None:
            self.pack()
            return False
        backend = self.backend
        stream = self.node_streams[0]
        kernels.track_stream(stream)
        backend.launch_graph_exec_trusted(
            graph, tuple([(prepared.buffers, prepared.scalars) for prepared in launches]), stream
        )
        self.launches += len(launches)
        others = [each for each in self.used_streams if each is not stream]
        if others:  # the run's other streams end with the graph, as they would node by node
            end = backend.create_event()
            self.owned.append(end)
            backend.record_event(end, stream)
            for other in others:
                backend.wait_event(other, end)
        return True

    def pack(self) -> None:
        """Pack each distinct launch for trusted enqueues (the graph path leaves them unpacked)."""
        kernels = self.kernels
        for index, prepared in enumerate(self.prepared):
            if prepared.arguments is None:
                self.prepared[index] = kernels.repack(prepared)

    # ----- host order ----------------------------------------------------------------------

    async def enqueue_host_order(self) -> None:
        graph = self.schedule.graph
        nodes = graph.nodes
        loop_at = self.schedule.loop_at
        index = 0
        while index < len(nodes):
            loop = loop_at.get(index)
            if loop is not None:
                await self._enqueue_loop(loop)
                index += loop.node_count
                continue
            self._enqueue_node(index, self.prepared[self.schedule.node_variant[index]], ())
            index += 1
            if not self.launches % _YIELD_EVERY:
                await checkpoint()

    async def _enqueue_loop(self, loop: GraphLoop) -> None:
        if loop.trip_count == 0:
            return
        first, end = loop.first_node_index, loop.first_node_index + loop.node_count
        variants = self._loop_variants(loop)
        for iteration in range(loop.trip_count):
            prepared = variants[iteration % 2]
            for index in range(first, end):
                self._enqueue_node(index, prepared[index - first], ())
                if not self.launches % _YIELD_EVERY:
                    await checkpoint()

    def _loop_variants(
        self, loop: GraphLoop, *, pack: bool = True
    ) -> tuple[list[PreparedLaunch], list[PreparedLaunch]]:
        """The loop's launches for even and odd iterations (carried slots swapped)."""
        first, end = loop.first_node_index, loop.first_node_index + loop.node_count
        if not loop.carries:
            same = [self.prepared[self.schedule.node_variant[i]] for i in range(first, end)]
            return same, same
        result = []
        for parity in (0, 1):
            remapped = dict(self.slots)
            for carry in loop.carries:
                initial = _bound(self.slots, carry.initial_slot_id)
                output = _bound(self.slots, carry.output_slot_id)
                read, write = (initial, output) if parity == 0 else (output, initial)
                remapped[carry.input_slot_id] = read.with_access("read_write")
                remapped[carry.output_slot_id] = write.with_access("read_write")
            kernel_ids = self.kernels.kernel_ids
            variant = [
                self.kernels.prepare_launch(
                    node.kernel_index,
                    remapped,
                    self.counts.get(kernel_ids[node.kernel_index]),
                    tuning=node.tuning,
                    runtime_scalar_arguments=node.runtime_scalar_arguments,
                    pack=pack,
                )
                for node in self.schedule.graph.nodes[first:end]
            ]
            for prepared in variant:
                self.kernels.check_live(prepared)
            result.append(variant)
        return result[0], result[1]

    # ----- dependency events ---------------------------------------------------------------

    async def enqueue_with_events(self) -> None:
        """Enqueue in list order with device-side waits between streams.

        Dependencies point forward, so when a node's turn comes every producer
        it waits for has already recorded its event: the host never waits, and
        the streams overlap on the device as far as the dependencies allow.
        """
        backend = self.backend
        schedule = self.schedule
        events = self.dependency_events
        for producer in schedule.producers:
            events[producer] = backend.create_event()
            self.owned.append(events[producer])
        prepared = self.prepared
        variant = schedule.node_variant
        cross_waits = schedule.cross_waits
        node_streams = self.node_streams
        for index in range(len(node_streams)):
            waits = cross_waits[index]
            self._enqueue_node(
                index, prepared[variant[index]], [events[p] for p in waits] if waits else ()
            )
            event = events.get(index)
            if event is not None:
                backend.record_event(event, node_streams[index])
            if not self.launches % _YIELD_EVERY:
                await checkpoint()

    # ----- shared --------------------------------------------------------------------------

    def _enqueue_node(
        self, index: int, prepared: PreparedLaunch, dependency_waits: Sequence[EventHandle]
    ) -> None:
        node = self.schedule.graph.nodes[index]
        events = self.events
        if node.wait_events:
            dependency_waits = [*dependency_waits, *(events[i] for i in node.wait_events)]
        signal = None if node.signal_event is None else events[node.signal_event]
        self.kernels.enqueue(
            prepared, self.node_streams[index], dependency_waits, signal, trusted=True
        )
        self.launches += 1

    def finish(self) -> GraphRun:
        """Register the end of each stream of the run and hand back the run."""
        backend = self.backend
        tails: dict[int, CompletionLatch] = {}
        for stream in self.used_streams:
            latch = CompletionLatch()
            backend.notify_when_stream_complete(stream, latch)
            tails[id(stream)] = latch
        node_tails = [tails[id(stream)] for stream in self.node_streams]
        return GraphRun(
            backend,
            self.schedule,
            list(tails.values()),
            node_tails,
            self.dependency_events,
            self.launches,
        )


def _bound(slots: Mapping[int, BufferBinding], slot_id: int) -> BufferBinding:
    binding = slots.get(slot_id)
    if binding is None:
        raise InvalidBuffer(f"carried slot {slot_id} has no buffer bound")
    return binding


async def launch_all(
    kernels: LoadedKernels,
    slot_bindings: Sequence[SlotBinding] | Mapping[int, BufferBinding],
    element_count_buffers: Sequence[ElementCountBufferBinding] = (),
    options: LaunchOptions = LaunchOptions(),  # noqa: B008 - frozen, shared default
) -> GraphRun:
    """Launch every kernel of the plan once, in dataflow order, on ``options.stream``.

    The graph is :func:`~accy_async.plan.create_dataflow_launch_graph_plan`'s;
    the first kernel waits on ``options.wait_events`` and the last records
    ``options.signal_event``.
    """
    plan = kernels.artifact_plan
    if kernels.kernel_count != len(plan.kernels):
        raise InvalidArtifact("the loaded kernels do not match their artifact plan")
    if not plan.kernels:
        await checkpoint()
        return GraphRun()
    graph = _dataflow_graph(plan, options)
    events = [*options.wait_events]
    if options.signal_event is not None:
        events.append(options.signal_event)
    return await launch_graph(
        kernels,
        slot_bindings,
        graph,
        element_count_buffers,
        events=events,
        default_stream=options.stream,
    )


_dataflow_graphs: IdentityCache[LaunchGraphPlan] = IdentityCache(64)


def _dataflow_graph(plan: ArtifactPlan, options: LaunchOptions) -> LaunchGraphPlan:
    wait_count = len(options.wait_events)
    signal = options.signal_event is not None
    key = (plan, options.tuning)
    cached = _dataflow_graphs.get(key, (wait_count, signal))
    if cached is not None and not options.runtime_scalar_arguments:
        return cached
    graph = create_dataflow_launch_graph_plan(
        plan,
        tuning=options.tuning,
        runtime_scalar_arguments=tuple(options.runtime_scalar_arguments),
    )
    nodes = list(graph.nodes)
    if wait_count:
        nodes[0] = _replace(nodes[0], wait_events=tuple(range(wait_count)))
    if signal:
        nodes[-1] = _replace(nodes[-1], signal_event=wait_count)
    graph = LaunchGraphPlan(
        nodes=tuple(nodes),
        dependencies=graph.dependencies,
        event_count=wait_count + signal,
    )
    if not options.runtime_scalar_arguments:
        _dataflow_graphs.put(key, graph, (wait_count, signal))
    return graph


def _replace(node: GraphNode, **changes: object) -> GraphNode:
    return msgspec.structs.replace(node, **changes)
