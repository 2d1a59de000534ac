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

from ._graph_run import GraphRun, StreamEnd
from ._graph_schedule import Schedule
from ._loops import checkpoint
from ._prepared_launch import GraphTemplates, LaunchTemplate, check_slot
from .backends import Backend, BufferBinding, DeviceObject, EventHandle, StreamHandle
from .backends import GraphNode as BackendGraphNode
from .errors import InvalidBuffer, UnsupportedOperation
from .kernels import LoadedKernels, PreparedLaunch
from .plan import GraphLoop

__all__ = ["Run"]

_YIELD_EVERY: Final = 256
"""Enqueues between checkpoints, so a large graph never holds the event loop for long."""


class Run:
    """One launch of a graph: the enqueue loops and what they produce.

    ``templates`` are the schedule's distinct launches and ``buffers`` each
    one's buffers for this run (bound and checked by ``templates.bind``); the eager paths
    pack them into :class:`PreparedLaunch` objects (:meth:`pack`), the device
    graph only reads them.
    """

    def __init__(
        self,
        kernels: LoadedKernels,
        schedule: Schedule,
        templates: GraphTemplates,
        buffers: Sequence[tuple[BufferBinding, ...]],
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
        self.templates = templates.templates
        self.fills = templates.fills
        self.buffers = buffers
        self.prepared: list[PreparedLaunch] = []
        """Each distinct launch packed for trusted enqueues (by :meth:`pack`, eager paths)."""
        self.slots = slots
        self.counts = counts
        self.events = events
        self.owned = owned
        self.key_streams: list[StreamHandle | None] = [
            default_stream if key is None else stream_handles[key] for key in schedule.stream_keys
        ]
        """The stream of each of the schedule's ``stream_keys``."""
        self.used_streams: list[StreamHandle | None] = list(
            {id(s): s for s in self.key_streams}.values()
        )
        self.dependency_events: dict[int, EventHandle] = {}
        self.launches = 0

    def node_stream(self, index: int) -> StreamHandle | None:
        """The stream node ``index`` runs on."""
        return self.key_streams[self.schedule.node_stream[index]]

    # ----- one device graph ----------------------------------------------------------------

    def enqueue_as_device_graph(self, wanted: bool | None) -> bool:
        """Enqueue the whole run as one device graph.

        ``False`` (nothing enqueued) where it cannot be one and ``wanted`` is
        not ``True``; the caller then packs and enqueues node by node.
        """
        schedule = self.schedule
        templates = self.templates
        unrolled_variant = schedule.unrolled_variant
        if unrolled_variant is not None:  # every launch is one of the variants, each used
            pairs = [
                (buffers, template.scalars)
                for template, buffers in zip(templates, self.buffers, strict=True)
            ]
            arguments = tuple(map(pairs.__getitem__, unrolled_variant))
            fills = self.fills

            def node_templates() -> list[LaunchTemplate]:
                return list(map(templates.__getitem__, unrolled_variant))

        else:
            launches = self._unrolled_launches()
            arguments = tuple([(buffers, template.scalars) for template, buffers in launches])
            fills = any(template.fills for template, _ in launches)

            def node_templates() -> list[LaunchTemplate]:
                return [template for template, _ in launches]

        if fills:
            if wanted is True:
                raise UnsupportedOperation(
                    "this launch graph cannot run as one device graph: a kernel fills scratch"
                )
            return False
        kernels = self.kernels
        after = schedule.unrolled_after
        graph = kernels.device_graphs.get(
            schedule,
            lambda: [
                BackendGraphNode(template.loaded, template.config, after=after[position])
                for position, template in enumerate(node_templates())
            ],
            lambda: kernels.streams_used,
            wanted=wanted,
            what="the launch graph",
        )
        if graph is None:
            return False
        backend = self.backend
        stream = self.node_stream(0)
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

    def _unrolled_launches(self) -> list[tuple[LaunchTemplate, tuple[BufferBinding, ...]]]:
        """Every launch in enqueue order, carried slots alternating by iteration."""
        schedule = self.schedule
        loops = {loop.first_node_index: loop for loop in schedule.graph.loops if loop.carries}
        loop_of: dict[int, GraphLoop] = {}
        for loop in loops.values():
            for member in range(loop.first_node_index, loop.first_node_index + loop.node_count):
                loop_of[member] = loop
        variants = {first: self._loop_variants(loop) for first, loop in loops.items()}
        templates, buffers = self.templates, self.buffers
        launches: list[tuple[LaunchTemplate, tuple[BufferBinding, ...]]] = []
        for index, iteration in schedule.unrolled:
            carrying = loop_of.get(index)
            if carrying is not None and iteration >= 0:
                bound = variants[carrying.first_node_index][iteration % 2]
                launches.append(bound[index - carrying.first_node_index])
            else:
                variant = schedule.node_variant[index]
                launches.append((templates[variant], buffers[variant]))
        return launches

    def pack(self) -> None:
        """Pack each distinct launch for trusted enqueues (the eager paths)."""
        self.prepared = [
            template.with_buffers(buffers, pack=True)
            for template, buffers in zip(self.templates, self.buffers, strict=True)
        ]

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
        if loop.carries:
            even, odd = self._loop_variants(loop)
            variants = (
                [template.with_buffers(buffers, pack=True) for template, buffers in even],
                [template.with_buffers(buffers, pack=True) for template, buffers in odd],
            )
        else:
            same = [self.prepared[self.schedule.node_variant[i]] for i in range(first, end)]
            variants = (same, same)
        for iteration in range(loop.trip_count):
            prepared = variants[iteration % 2]
            for index in range(first, end):
                self._enqueue_node(index, prepared[index - first], ())
                if not self.launches % _YIELD_EVERY:
                    await checkpoint()

    def _loop_variants(
        self, loop: GraphLoop
    ) -> tuple[
        list[tuple[LaunchTemplate, tuple[BufferBinding, ...]]],
        list[tuple[LaunchTemplate, tuple[BufferBinding, ...]]],
    ]:
        """A carrying loop's launches for even and odd iterations (carried slots swapped).

        The run's slots and kernels were checked when it was bound; the carried
        slots' bindings are checked here (an initial slot may be bound by no launch).
        """
        first, end = loop.first_node_index, loop.first_node_index + loop.node_count
        for carry in loop.carries:
            for slot_id in (carry.initial_slot_id, carry.output_slot_id):
                check_slot(self.backend, _bound(self.slots, slot_id), f"slot {slot_id}")
        result = []
        for parity in (0, 1):
            remapped = dict(self.slots)
            for carry in loop.carries:
                initial = _bound(self.slots, carry.initial_slot_id)
                output = _bound(self.slots, carry.output_slot_id)
                read, write = (initial, output) if parity == 0 else (output, initial)
                remapped[carry.input_slot_id] = read.with_access("read_write")
                remapped[carry.output_slot_id] = write.with_access("read_write")
            variant = []
            for index in range(first, end):
                template = self.templates[self.schedule.node_variant[index]]
                variant.append(
                    (template, template.buffers(remapped, self.counts.get(template.kernel_id)))
                )
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
        for index in range(len(variant)):
            waits = cross_waits[index]
            self._enqueue_node(
                index, prepared[variant[index]], [events[p] for p in waits] if waits else ()
            )
            event = events.get(index)
            if event is not None:
                backend.record_event(event, self.node_stream(index))
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
            prepared, self.node_stream(index), dependency_waits, signal, trusted=True
        )
        self.launches += 1

    def finish(self) -> GraphRun:
        """Mark the end of each stream of the run and hand back the run."""
        backend = self.backend
        ends = {id(stream): StreamEnd(backend, stream) for stream in self.used_streams}
        return GraphRun(
            backend,
            self.schedule,
            list(ends.values()),
            [ends[id(stream)] for stream in self.key_streams],
            self.dependency_events,
            self.launches,
        )


def _bound(slots: Mapping[int, BufferBinding], slot_id: int) -> BufferBinding:
    binding = slots.get(slot_id)
    if binding is None:
        raise InvalidBuffer(f"carried slot {slot_id} has no buffer bound")
    return binding
