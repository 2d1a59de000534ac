"""A launch graph's schedule: what its launches need, derived once per (graph, plan).

:func:`schedule_of` validates the graph against the plan and works out the
distinct launches, whether dependencies cross streams (and so which nodes
record dependency events and which wait for them), each node's completion
marker, and the launches unrolled in enqueue order with what each follows
(the edges of the graph run as one device graph). Cached per (graph, plan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._cache import IdentityCache
from .plan import (
    ArtifactPlan,
    GraphDependency,
    GraphLoop,
    GraphNode,
    LaunchGraphPlan,
    validate_plan,
)

__all__ = ["Schedule", "schedule_of"]


@dataclass(frozen=True, slots=True, eq=False)
class Schedule:
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
    unrolled_variant: tuple[int, ...] | None
    """Per launch of ``unrolled``, its variant; ``None`` where a loop carries slots (its
    launches alternate between two bindings, not one variant)."""
    stream_keys: tuple[int | None, ...]
    """The graph's distinct node streams (``None``: the default), first use first."""
    node_stream: tuple[int, ...]
    """Per node, its stream's position in ``stream_keys``."""


_schedules: IdentityCache[Schedule] = IdentityCache(64)


def schedule_of(graph: LaunchGraphPlan, plan: ArtifactPlan) -> Schedule:
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
    stream_keys = list(dict.fromkeys(node.stream for node in nodes))
    key_position = {key: position for position, key in enumerate(stream_keys)}
    refusal = None
    if any(node.wait_events or node.signal_event is not None for node in nodes):
        refusal = "its nodes wait for or signal the caller's events"
    schedule = Schedule(
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
        unrolled_variant=(
            None
            if any(loop.carries for loop in graph.loops)
            else tuple(node_variant[index] for index, _ in unrolled)
        ),
        stream_keys=tuple(stream_keys),
        node_stream=tuple(key_position[node.stream] for node in nodes),
    )
    return _schedules.put((graph, plan), schedule)


def _unroll(
    graph: LaunchGraphPlan, uses_events: bool, cross: Sequence[Sequence[int]]
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, ...], ...]]:
    """Every launch the eager runner enqueues, in its order, with what each follows.

    Host order repeats a loop's nodes ``trip_count`` times; with dependency
    events every node runs once (as
    :meth:`~accy_async._graph_enqueue.Run.enqueue_with_events` does).
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
