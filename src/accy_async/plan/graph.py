"""Launch graph plans: nodes, dependencies, loops with carried slots, streams and events.

A plan names streams and events by index (``stream_count`` and ``event_count``
of them); :func:`accy_async.graph.launch_graph` binds the indices to real
backend streams and events when it runs the graph. A plan may also place its
nodes on devices, by index (``device_count`` of them):
:func:`accy_async.open_graph` binds the indices to backends, one per device.
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, Final

import msgspec

from ..errors import InvalidArtifact, UnsupportedOperation
from ._base import Base, ObjectId, plan_error
from .artifact_plan import NO_TUNING, ArtifactPlan, LaunchTuning
from .scalars import ScalarArgument

__all__ = [
    "GraphDependency",
    "GraphLoop",
    "GraphNode",
    "LaunchGraphPlan",
    "LoopCarry",
    "create_dataflow_launch_graph_plan",
]

_MAX_GRAPH_NODES: Final = 1_000_000
_MAX_STREAMS: Final = 64
_MAX_DEVICES: Final = 64
_MAX_EVENTS: Final = 4096
_MAX_TRIP_COUNT: Final = 2**32 - 1

NodeIndex = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_GRAPH_NODES)]
StreamIndex = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_STREAMS)]
EventIndex = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_EVENTS)]
DeviceIndex = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_DEVICES)]


class GraphNode(Base, frozen=True):
    """One launch of kernel ``kernel_index`` of the artifact plan.

    ``stream`` is an index into the run's streams (``None``: the run's default
    stream). ``wait_events`` and ``signal_event`` index the run's external
    events: the launch waits on the former and the latter is recorded after it.
    ``runtime_scalar_arguments`` override the kernel's defaults when given.
    ``device`` is an index into the devices the graph runs on (see
    :attr:`LaunchGraphPlan.device_count`).
    """

    kernel_index: NodeIndex
    stream: StreamIndex | None = None
    wait_events: tuple[EventIndex, ...] = ()
    signal_event: EventIndex | None = None
    tuning: LaunchTuning = NO_TUNING
    runtime_scalar_arguments: tuple[ScalarArgument, ...] = ()
    device: DeviceIndex = 0


class GraphDependency(Base, frozen=True):
    """The consumer node reads (or overwrites) what the producer node writes."""

    producer_node_index: NodeIndex
    consumer_node_index: NodeIndex


class LoopCarry(Base, frozen=True):
    """A buffer carried between loop iterations by ping-pong.

    Even iterations bind the logical ``input_slot_id`` to the physical
    ``initial_slot_id`` and the logical ``output_slot_id`` to its own physical
    slot; odd iterations swap the two physical slots. After ``trip_count``
    iterations the last output is in ``output_slot_id``'s buffer when the count
    is odd and in ``initial_slot_id``'s buffer when it is even (and not zero).
    """

    input_slot_id: ObjectId
    output_slot_id: ObjectId
    initial_slot_id: ObjectId


class GraphLoop(Base, frozen=True):
    """Nodes ``first_node_index .. first_node_index + node_count`` repeated ``trip_count`` times."""

    first_node_index: NodeIndex
    node_count: Annotated[int, msgspec.Meta(ge=1, le=_MAX_GRAPH_NODES)]
    trip_count: Annotated[int, msgspec.Meta(ge=0, le=_MAX_TRIP_COUNT)]
    carries: tuple[LoopCarry, ...] = ()


class LaunchGraphPlan(Base, frozen=True):
    """A dataflow launch graph over the kernels of one artifact plan.

    Nodes launch in list order on their streams; a dependency between nodes on
    different streams becomes a device-side event wait. Dependencies must point
    forward in the list (a backward one is reported, and named a cycle when it
    closes one). Loops run in host order and cannot be combined with
    cross-stream dependencies.

    With ``device_count`` above one the nodes are placed on devices
    (:attr:`GraphNode.device`): each device's nodes run in list order on one
    stream of its own, and a node reads the latest version of each of its
    slots, copied from the device that wrote it (see
    :func:`accy_async.open_graph`). Such a graph names no streams, events or
    loops.
    """

    nodes: Annotated[tuple[GraphNode, ...], msgspec.Meta(max_length=_MAX_GRAPH_NODES)]
    dependencies: tuple[GraphDependency, ...] = ()
    loops: tuple[GraphLoop, ...] = ()
    stream_count: Annotated[int, msgspec.Meta(ge=0, le=_MAX_STREAMS)] = 0
    event_count: Annotated[int, msgspec.Meta(ge=0, le=_MAX_EVENTS)] = 0
    device_count: Annotated[int, msgspec.Meta(ge=1, le=_MAX_DEVICES)] = 1

    def __post_init__(self) -> None:
        self._check_devices()
        self._check_nodes()
        self._check_dependencies()
        self._check_loops()

    def _check_devices(self) -> None:
        for index, node in enumerate(self.nodes):
            if node.device >= self.device_count:
                raise plan_error(
                    f"device {node.device} does not exist (the graph has {self.device_count})",
                    "nodes",
                    index,
                    "device",
                )
        if self.device_count == 1:
            return
        for field, count in (
            ("stream_count", self.stream_count),
            ("event_count", self.event_count),
            ("loops", len(self.loops)),
        ):
            if count:
                raise plan_error(
                    f"a graph over {self.device_count} devices takes no streams, events or "
                    "loops (each device's nodes run on one stream of its own)",
                    field,
                )

    def _check_nodes(self) -> None:
        for index, node in enumerate(self.nodes):
            if node.stream is not None and node.stream >= self.stream_count:
                raise plan_error(
                    f"stream {node.stream} does not exist (the graph has {self.stream_count})",
                    "nodes",
                    index,
                    "stream",
                )
            for wait_index, event in enumerate(node.wait_events):
                if event >= self.event_count:
                    raise plan_error(
                        f"event {event} does not exist (the graph has {self.event_count})",
                        "nodes",
                        index,
                        "wait_events",
                        wait_index,
                    )
            if node.signal_event is not None and node.signal_event >= self.event_count:
                raise plan_error(
                    f"event {node.signal_event} does not exist (the graph has {self.event_count})",
                    "nodes",
                    index,
                    "signal_event",
                )

    def _check_dependencies(self) -> None:
        node_count = len(self.nodes)
        seen: set[tuple[int, int]] = set()
        for index, dependency in enumerate(self.dependencies):
            producer = dependency.producer_node_index
            consumer = dependency.consumer_node_index
            for field, node in (
                ("producer_node_index", producer),
                ("consumer_node_index", consumer),
            ):
                if node >= node_count:
                    raise plan_error(
                        f"node {node} does not exist (the graph has {node_count})",
                        "dependencies",
                        index,
                        field,
                    )
            if producer == consumer:
                raise plan_error(f"node {producer} depends on itself", "dependencies", index)
            if (producer, consumer) in seen:
                raise plan_error(
                    f"duplicate dependency {producer} -> {consumer}", "dependencies", index
                )
            seen.add((producer, consumer))
        for index, dependency in enumerate(self.dependencies):
            producer = dependency.producer_node_index
            consumer = dependency.consumer_node_index
            if producer > consumer:
                cycle = _path(self.dependencies, consumer, producer)
                if cycle is not None:
                    nodes = " -> ".join(str(node) for node in [producer, *cycle])
                    raise plan_error(f"dependencies form a cycle: {nodes}", "dependencies", index)
                raise plan_error(
                    f"producer {producer} comes after its consumer {consumer}; nodes launch in "
                    "list order",
                    "dependencies",
                    index,
                )

    def _check_loops(self) -> None:
        end_of_previous = 0
        ordered = sorted(enumerate(self.loops), key=lambda item: item[1].first_node_index)
        for index, loop in ordered:
            if loop.first_node_index < end_of_previous:
                raise plan_error("loops overlap", "loops", index, "first_node_index")
            end = loop.first_node_index + loop.node_count
            if end > len(self.nodes):
                raise plan_error(
                    f"loop covers nodes up to {end - 1} but the graph has {len(self.nodes)}",
                    "loops",
                    index,
                    "node_count",
                )
            end_of_previous = end

    def needs_dependency_events(self) -> bool:
        """Whether some dependency joins nodes on different streams."""
        nodes = self.nodes
        return any(
            nodes[dep.producer_node_index].stream != nodes[dep.consumer_node_index].stream
            for dep in self.dependencies
        )

    def validate(self, artifact_plan: ArtifactPlan) -> None:
        """Check the graph against the artifact plan it launches.

        Raises :class:`InvalidArtifact` for a node naming a kernel the plan does
        not have or a carry naming a slot it lacks, and
        :class:`UnsupportedOperation` for loops in a graph that needs
        cross-stream dependency events.
        """
        kernel_count = len(artifact_plan.kernels)
        for index, node in enumerate(self.nodes):
            if node.kernel_index >= kernel_count:
                raise InvalidArtifact(
                    f"kernel {node.kernel_index} does not exist (the plan has {kernel_count})",
                    path=f"$.nodes[{index}].kernel_index",
                )
        slot_ids = {slot.slot_id for slot in artifact_plan.slots}
        for loop_index, loop in enumerate(self.loops):
            for carry_index, carry in enumerate(loop.carries):
                for field in ("input_slot_id", "output_slot_id", "initial_slot_id"):
                    if getattr(carry, field) not in slot_ids:
                        raise InvalidArtifact(
                            f"slot {getattr(carry, field)} is not a slot of the plan",
                            path=f"$.loops[{loop_index}].carries[{carry_index}].{field}",
                        )
        if self.loops and self.needs_dependency_events():
            raise UnsupportedOperation(
                "loops cannot be combined with cross-stream dependencies", path="$.loops"
            )


def _path(dependencies: tuple[GraphDependency, ...], start: int, goal: int) -> list[int] | None:
    """A chain of dependencies from ``start`` to ``goal`` (both included), or ``None``."""
    successors: dict[int, list[int]] = {}
    for dependency in dependencies:
        successors.setdefault(dependency.producer_node_index, []).append(
            dependency.consumer_node_index
        )
    previous: dict[int, int] = {start: start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            chain = [node]
            while chain[-1] != start:
                chain.append(previous[chain[-1]])
            return chain[::-1]
        for successor in successors.get(node, ()):
            if successor not in previous:
                previous[successor] = node
                queue.append(successor)
    return None


def create_dataflow_launch_graph_plan(
    artifact_plan: ArtifactPlan,
    *,
    tuning: LaunchTuning = NO_TUNING,
    runtime_scalar_arguments: tuple[ScalarArgument, ...] = (),
) -> LaunchGraphPlan:
    """One node per kernel, in plan order, with the dependencies its slots imply.

    A kernel depends on the last earlier kernel that wrote a slot it reads
    (read after write), on the last earlier writer of the slot it writes (write
    after write), and on every earlier kernel that read the slot it writes
    since that write (write after read), so the graph stays correct when its
    nodes are spread over several streams. All nodes are on the default stream.
    """
    nodes = tuple(
        GraphNode(
            kernel_index=index,
            tuning=tuning,
            runtime_scalar_arguments=runtime_scalar_arguments,
        )
        for index in range(len(artifact_plan.kernels))
    )
    last_writer: dict[int, int] = {}
    readers_since_write: dict[int, list[int]] = {}
    pairs: dict[tuple[int, int], None] = {}
    for consumer, kernel in enumerate(artifact_plan.kernels):
        for slot_id in kernel.input_slot_ids:
            if slot_id in last_writer:
                pairs[(last_writer[slot_id], consumer)] = None
        output = kernel.output_slot_id
        if output in last_writer:
            pairs[(last_writer[output], consumer)] = None
        for reader in readers_since_write.get(output, ()):
            if reader != consumer:
                pairs[(reader, consumer)] = None
        for slot_id in kernel.input_slot_ids:
            readers_since_write.setdefault(slot_id, []).append(consumer)
        last_writer[output] = consumer
        readers_since_write[output] = []
    dependencies = tuple(
        GraphDependency(producer_node_index=producer, consumer_node_index=consumer)
        for producer, consumer in sorted(pairs, key=lambda pair: (pair[1], pair[0]))
    )
    return LaunchGraphPlan(nodes=nodes, dependencies=dependencies)
