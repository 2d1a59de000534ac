"""One launch of a launch graph: the loops that enqueue it, and what they produce.

A :class:`Run` enqueues a graph's launches, prepared by
:func:`~accy_async.graph.launch_graph`, one of three ways: as one device graph,
in host order (loops repeated, carried slots ping-ponging between two buffers),
or with dependency events between streams; :meth:`Run.finish` hands back the
:class:`~accy_async.graph.GraphRun`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from ._graph_run import GraphRun
from ._graph_schedule import Schedule
from ._loops import checkpoint
from .backends import Backend, BufferBinding, DeviceObject, EventHandle, StreamHandle
from .backends import GraphNode as BackendGraphNode
from .errors import InvalidBuffer, UnsupportedOperation
from .kernels import LoadedKernels, PreparedLaunch
from .plan import GraphLoop
from .waiting import CompletionLatch

__all__ = ["Run"]

_YIELD_EVERY: Final = 256
"""Enqueues between checkpoints, so a large graph never holds the event loop for long."""


class Run:
    """One launch of a graph: the enqueue loops and what they produce."""

    def __init__(
        self,
        kernels: LoadedKernels,
        schedule: Schedule,
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
        unrolled_variant = schedule.unrolled_variant
        if unrolled_variant is not None:  # every launch is one of the variants, each used
            distinct = self.prepared
            pairs = [(prepared.buffers, prepared.scalars) for prepared in distinct]
            arguments = tuple([pairs[variant] for variant in unrolled_variant])
            launches = distinct  # what the checks below read; the nodes, only to make a graph

            def node_launches() -> list[PreparedLaunch]:
                return [distinct[variant] for variant in unrolled_variant]

        else:
            launches = self._unrolled_launches()
            arguments = tuple([(prepared.buffers, prepared.scalars) for prepared in launches])

            def node_launches() -> list[PreparedLaunch]:
                return launches

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
                for position, prepared in enumerate(node_launches())
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
        backend.launch_graph_exec_trusted(graph, arguments, stream)
        self.launches += len(arguments)
        others = [each for each in self.used_streams if each is not stream]
        if others:  # the run's other streams end with the graph, as they would node by node
            end = backend.create_event()
            self.owned.append(end)
            backend.record_event(end, stream)
            for other in others:
                backend.wait_event(other, end)
        return True

    def _unrolled_launches(self) -> list[PreparedLaunch]:
        """Every launch in enqueue order, carried slots alternating by iteration."""
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
        return launches

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
