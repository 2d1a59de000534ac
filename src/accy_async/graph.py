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

This module checks and prepares a launch. What a graph needs at launch time,
derived once per (graph, plan), lives in :mod:`accy_async._graph_schedule`;
the enqueue loops (one device graph, host order, dependency events) in
:mod:`accy_async._graph_enqueue`; :class:`GraphRun` and
:class:`NodeCompletion` in :mod:`accy_async._graph_run`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from ._cache import IdentityCache
from ._graph_enqueue import Run
from ._graph_run import GraphRun, NodeCompletion
from ._graph_schedule import schedule_of
from ._loops import admit, checkpoint
from .backends import BufferBinding, DeviceObject, EventHandle, StreamLike
from .errors import InvalidArtifact, InvalidBuffer, LaunchArgumentMismatch, UnsupportedOperation
from .kernels import (
    ElementCountBufferBinding,
    LaunchOptions,
    LoadedKernels,
    SlotBinding,
    slot_map,
)
from .plan import (
    ArtifactPlan,
    GraphNode,
    LaunchGraphPlan,
    create_dataflow_launch_graph_plan,
)
from .waiting import release_when_idle

__all__ = ["GraphRun", "NodeCompletion", "launch_all", "launch_graph"]


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
    if graph.device_count > 1:
        raise UnsupportedOperation(
            f"a graph over {graph.device_count} devices runs through open_graph, given a "
            "backend per device",
            path="$.device_count",
        )
    schedule = schedule_of(graph, plan)
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
    if as_graph and not kernels.device_graphs.prepared:
        await kernels.device_graphs.prepare(kernels.loaded)
    slots = slot_bindings if isinstance(slot_bindings, Mapping) else slot_map(slot_bindings)
    counts = {entry.kernel_id: entry.binding for entry in element_count_buffers}
    templates = kernels.graph_templates(schedule)
    buffers = templates.bind(backend, slots, counts)
    for event in events:
        if not backend.owns(event):
            raise InvalidBuffer(f"{event!r} is not a live event of this backend")
    stream_handles = [backend.adopt_stream(stream) for stream in streams or ()]
    default = None if default_stream is None else backend.adopt_stream(default_stream)
    owned: list[DeviceObject] = []
    run: Run | None = None
    try:
        while len(stream_handles) < graph.stream_count:
            stream_handles.append(backend.create_stream())
            owned.append(stream_handles[-1])
        run = Run(
            kernels,
            schedule,
            templates,
            buffers,
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
