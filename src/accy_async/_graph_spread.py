"""A launch graph over several devices: each device's nodes in order on its lane's stream.

What :class:`~accy_async.graph_call.GraphCall` runs for a graph with
``device_count`` above one. Every device keeps its own copy of each slot its
nodes use. Nodes are enqueued in list order (dependencies point forward):
before a node runs on device ``d``, each of its slots whose latest version is
on another device is copied to ``d`` (:func:`~accy_async.copy_between`: on the
device, after the writer's stream, between CUDA backends), and ``d``'s stream
waits for the stream of each producer the plan names on another device (on
the device where the backends can, else on the host). After it, the slot it
writes is ``d``'s alone until copied elsewhere. A copy reads its source on the
destination's stream, so before a device overwrites its copy of a slot (a
kernel's output, or a copy coming in) its stream waits for every stream that
copied that slot out of it since. Reads come from the device holding the
latest version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._graph_lane import GraphLane
from ._loops import checkpoint
from .backends import BufferBinding
from .buffers import copy_between
from .errors import UnsupportedOperation
from .kernels import LaunchOptions, LoadedKernels
from .plan import ArtifactPlan, LaunchGraphPlan
from .waiting import wait_stream

__all__ = ["device_slots", "run_spread"]


def device_slots(graph: LaunchGraphPlan, plan: ArtifactPlan) -> list[set[int]]:
    """The slots each device's nodes use; a slot no node uses lives on device 0."""
    used: list[set[int]] = [set() for _ in range(graph.device_count)]
    for node in graph.nodes:
        kernel = plan.kernels[node.kernel_index]
        used[node.device].update((kernel.output_slot_id, *kernel.input_slot_ids))
    everywhere = set().union(*used)
    used[0].update(slot.slot_id for slot in plan.slots if slot.slot_id not in everywhere)
    return used


async def run_spread(
    graph: LaunchGraphPlan,
    plan: ArtifactPlan,
    lanes: Sequence[GraphLane],
    kernels: Sequence[LoadedKernels],
    bindings: Sequence[Mapping[int, BufferBinding]],
) -> dict[int, int]:
    """Enqueue every node (see the module docstring); the device holding each slot's latest.

    ``lanes``, ``kernels`` and ``bindings`` are per device index; every slot
    starts valid on each device that binds it (the caller put the same
    start there). Returns once everything is enqueued; the caller awaits the
    lanes' streams.
    """
    readers: dict[tuple[int, int], set[int]] = {}
    """The devices whose streams copied a device's copy of a slot out since it was written."""

    async def before_writing(slot_id: int, device: int) -> None:
        for reader in readers.pop((slot_id, device), ()):
            if reader != device:  # that copy out must have run before this overwrite
                await _follow(lanes[device], lanes[reader])

    valid: dict[int, set[int]] = {}
    for device, device_bindings in enumerate(bindings):
        for slot_id in device_bindings:
            valid.setdefault(slot_id, set()).add(device)
    latest: dict[int, int] = {}
    producers: dict[int, list[int]] = {}
    for dependency in graph.dependencies:
        producers.setdefault(dependency.consumer_node_index, []).append(
            dependency.producer_node_index
        )
    for index, node in enumerate(graph.nodes):
        device = node.device
        lane = lanes[device]
        kernel = plan.kernels[node.kernel_index]
        for slot_id in (kernel.output_slot_id, *kernel.input_slot_ids):
            here = valid[slot_id]
            if device not in here:  # its latest version is elsewhere: copy it over
                source = latest.get(slot_id, min(here))
                into = bindings[device][slot_id]
                await before_writing(slot_id, device)
                await copy_between(
                    lanes[source].backend,
                    bindings[source][slot_id].handle,
                    lane.backend,
                    into.handle,
                    into.byte_size,
                    after=lanes[source].stream,
                    stream=lane.stream,
                )
                here.add(device)
                readers.setdefault((slot_id, source), set()).add(device)
        for producer in producers.get(index, ()):
            other = graph.nodes[producer].device
            if other != device:
                await _follow(lane, lanes[other])
        written = [kernel.output_slot_id]
        if kernel.scratch_fill_pattern is not None and kernel.input_slot_ids:
            written.append(kernel.input_slot_ids[-1])  # filled, then the kernel may write it
        for slot_id in written:
            await before_writing(slot_id, device)
        count = lane.count_bindings.get(kernel.kernel_id)
        kernels[device].launch_kernel(
            node.kernel_index,
            bindings[device],
            None if count is None else count.binding,
            LaunchOptions(
                stream=lane.stream,
                tuning=node.tuning,
                runtime_scalar_arguments=node.runtime_scalar_arguments,
            ),
        )
        for slot_id in written:
            valid[slot_id] = {device}
            latest[slot_id] = device
        await checkpoint()
    return {slot_id: latest.get(slot_id, min(here)) for slot_id, here in valid.items()}


async def _follow(lane: GraphLane, producer: GraphLane) -> None:
    """``lane``'s stream waits for ``producer``'s: on the device where it can, else here."""
    try:
        lane.backend.follow_peer_stream(lane.stream, producer.backend, producer.stream)
    except UnsupportedOperation:
        await wait_stream(producer.backend, producer.stream)
