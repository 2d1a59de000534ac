"""Launch graphs: host order, loops with carried slots, streams joined by dependency events."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import accy_async as accy
from accy_async import plan as p
from accy_async.graph import launch_all, launch_graph
from accy_async.kernels import LaunchOptions, SlotBinding, load_kernels

from .plans import CHAIN_N, CHAIN_SIZES, bind_all, chain_plan, destroy_bindings, diamond

N = CHAIN_N
SIZES = CHAIN_SIZES


def ping_pong(trips: int, *, then: tuple[int, ...] = ()) -> p.LaunchGraphPlan:
    """Kernel 0 fills slot 1; kernel 4 (add one, slot 5 into 6) runs ``trips`` times, each
    output carried back as the next input (slot 1 the first); then the kernels ``then``."""
    return p.LaunchGraphPlan(
        nodes=tuple(p.GraphNode(kernel_index=i) for i in (0, 4, *then)),
        loops=(
            p.GraphLoop(
                first_node_index=1,
                node_count=1,
                trip_count=trips,
                carries=(p.LoopCarry(input_slot_id=5, output_slot_id=6, initial_slot_id=1),),
            ),
        ),
    )


async def read_f32(backend: accy.Backend, binding: SlotBinding) -> np.ndarray:
    return np.frombuffer(
        await accy.wait_read(backend.enqueue_read(binding.binding.handle)), np.float32
    )


# ----- recording: exact counts ---------------------------------------------------------------


async def test_host_order_graph_enqueues_in_list_order_without_events(
    recording: accy.RecordingBackend,
) -> None:
    bindings = bind_all(recording, SIZES)
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        run = await launch_graph(kernels, bindings, diamond((None, None, None, None)))
        await run.wait()
        assert run.done and run.enqueued_launches == 4
    assert [launch.kernel_name for launch in recording.launches] == [
        "slow_fill_f32",
        "copy_f32",
        "add_one_f32",
        "add_f32",
    ]
    assert recording.calls["event"] == 0 and recording.calls["record"] == 0
    destroy_bindings(recording, bindings)


async def test_a_diamond_on_two_streams_waits_on_one_event_per_cross_stream_producer(
    recording: accy.RecordingBackend,
) -> None:
    bindings = bind_all(recording, SIZES)
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        before = set(recording.live_objects())
        run = await launch_graph(kernels, bindings, diamond((0, 0, 1, 0)))
        await run.wait()
        recording.collect_deferred()
        assert set(recording.live_objects()) == before  # events and streams released
    launches = recording.launches
    assert [launch.kernel_name for launch in launches] == [
        "slow_fill_f32",
        "copy_f32",
        "add_one_f32",
        "add_f32",
    ]
    events = recording.calls["event"]
    assert events == 2  # producers 0 and 2 have consumers on another stream
    a, b, c, d = launches
    assert a.stream_id == b.stream_id == d.stream_id != c.stream_id
    assert c.wait_event_ids and d.wait_event_ids and not a.wait_event_ids and not b.wait_event_ids
    assert c.wait_event_ids[0] != d.wait_event_ids[0]
    recorded = dict(recording.records)
    assert recorded[c.wait_event_ids[0]] == a.stream_id  # A's event, recorded on A's stream
    assert recorded[d.wait_event_ids[0]] == c.stream_id
    created_streams = recording.calls["stream"]
    assert created_streams == 2
    assert recording.destroy_count == events + created_streams + len(recording.loaded_ids)
    destroy_bindings(recording, bindings)


async def test_given_streams_and_external_events_are_used_not_created(
    recording: accy.RecordingBackend,
) -> None:
    bindings = bind_all(recording, SIZES)
    streams = [recording.create_stream(), recording.create_stream()]
    external = [recording.create_event(), recording.create_event()]
    graph = p.LaunchGraphPlan(
        nodes=(
            p.GraphNode(kernel_index=0, stream=0, wait_events=(0,)),
            p.GraphNode(kernel_index=1, stream=1, signal_event=1),
        ),
        dependencies=(p.GraphDependency(producer_node_index=0, consumer_node_index=1),),
        stream_count=2,
        event_count=2,
    )
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        with pytest.raises(accy.LaunchArgumentMismatch, match="uses 2 events, 1 were given"):
            await launch_graph(kernels, bindings, graph, streams=streams, events=external[:1])
        with pytest.raises(accy.LaunchArgumentMismatch, match="uses 2 streams, 1 were given"):
            await launch_graph(kernels, bindings, graph, streams=streams[:1], events=external)
        await (
            await launch_graph(kernels, bindings, graph, streams=streams, events=external)
        ).wait()
    first, second = recording.launches
    assert first.stream_id == streams[0].id and second.stream_id == streams[1].id
    assert first.wait_event_ids == (external[0].id,)
    assert second.signal_event_id == external[1].id
    assert recording.calls["stream"] == 2  # only ours
    recording.destroy_all([*streams, *external])
    destroy_bindings(recording, bindings)


@pytest.mark.parametrize("trips", range(10))
async def test_loops_ping_pong_carried_slots(recording: accy.RecordingBackend, trips: int) -> None:
    bindings = bind_all(recording, SIZES)
    ids = {b.slot_id: b.binding.handle.id for b in bindings}
    graph = ping_pong(trips, then=(1,))
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        run = await launch_graph(kernels, bindings, graph)
        await run.wait()
    assert run.enqueued_launches == trips + 2
    loop_launches = recording.launches[1:-1]
    assert len(loop_launches) == trips
    for iteration, launch in enumerate(loop_launches):
        read, write = (ids[1], ids[6]) if iteration % 2 == 0 else (ids[6], ids[1])
        assert launch.buffer_ids == (write, read)
        assert launch.buffer_access == ("write_only", "read_only")
    destroy_bindings(recording, bindings)


async def test_loops_cannot_cross_streams(recording: accy.RecordingBackend) -> None:
    graph = p.LaunchGraphPlan(
        nodes=(p.GraphNode(kernel_index=0, stream=0), p.GraphNode(kernel_index=1, stream=1)),
        dependencies=(p.GraphDependency(producer_node_index=0, consumer_node_index=1),),
        loops=(p.GraphLoop(first_node_index=0, node_count=1, trip_count=2),),
        stream_count=2,
    )
    bindings = bind_all(recording, SIZES)
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        with pytest.raises(accy.UnsupportedOperation, match="loops cannot be combined"):
            await launch_graph(kernels, bindings, graph)
        bad_kernel = p.LaunchGraphPlan(nodes=(p.GraphNode(kernel_index=9),))
        with pytest.raises(accy.InvalidArtifact, match="kernel 9 does not exist"):
            await launch_graph(kernels, bindings, bad_kernel)
    assert recording.launch_count == 0 and recording.calls["stream"] == 0
    destroy_bindings(recording, bindings)


async def test_an_error_in_a_node_stops_enqueueing_and_releases_everything() -> None:
    backend = accy.RecordingBackend()
    bindings = bind_all(backend, SIZES)
    async with await load_kernels(backend, chain_plan(backend)) as kernels:
        live_before = set(backend.live_objects())
        backend.inject_fault("launch", after=2)
        with pytest.raises(accy.RuntimeUnavailable, match="launch call 3"):
            await launch_graph(kernels, bindings, diamond((0, 0, 1, 0)))
        assert backend.launch_count == 2
        assert set(backend.live_objects()) == live_before  # events and streams destroyed
        created = backend.calls["event"] + backend.calls["stream"]
        assert backend.destroy_count == created
        # The next clean run passes.
        await (await launch_graph(kernels, bindings, diamond((0, 0, 1, 0)))).wait()
        assert backend.launch_count == 6
    destroy_bindings(backend, bindings)
    await backend.aclose()


async def test_cancelling_a_launch_stops_enqueueing_and_releases_everything(
    recording: accy.RecordingBackend,
) -> None:
    bindings = bind_all(recording, SIZES)
    nodes = tuple(p.GraphNode(kernel_index=1, stream=i % 2) for i in range(2000))
    deps = tuple(
        p.GraphDependency(producer_node_index=i, consumer_node_index=i + 1) for i in range(1999)
    )
    graph = p.LaunchGraphPlan(nodes=nodes, dependencies=deps, stream_count=2)
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        live_before = set(recording.live_objects())
        with anyio.CancelScope() as scope:
            scope.cancel()
            await launch_graph(kernels, bindings, graph)
        assert scope.cancelled_caught
        assert recording.launch_count == 0  # cancelled at its first checkpoint: nothing enqueued

        async def cancel_once_started() -> None:
            while recording.launch_count == 0:
                await anyio.lowlevel.checkpoint()
            scope.cancel()

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_once_started)
                await launch_graph(kernels, bindings, graph)
        assert scope.cancelled_caught
        assert 0 < recording.launch_count < 2000
        assert set(recording.live_objects()) == live_before
    destroy_bindings(recording, bindings)


async def test_node_completions_follow_the_device(recording: accy.RecordingBackend) -> None:
    backend = accy.RecordingBackend(completion="manual")
    bindings = bind_all(backend, SIZES)
    async with await load_kernels(backend, chain_plan(backend)) as kernels:
        run = await launch_graph(kernels, bindings, diamond((0, 0, 1, 0)))
        assert [run.done, run.node(0).done] == [False, False]
        backend.complete_all()
        await run.node(2).wait()
        await run.wait()
        assert [run.done, *(run.node(i).done for i in range(4))] == [True] * 5
    destroy_bindings(backend, bindings)
    await backend.aclose()


async def test_launch_all_runs_the_dataflow_graph(recording: accy.RecordingBackend) -> None:
    bindings = bind_all(recording, SIZES)
    stream = recording.create_stream()
    before, after = recording.create_event(), recording.create_event()
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        run = await launch_all(
            kernels,
            bindings,
            options=LaunchOptions(stream=stream, wait_events=[before], signal_event=after),
        )
        await run.wait()
    assert recording.launch_count == 5
    assert {launch.stream_id for launch in recording.launches} == {stream.id}
    assert recording.launches[0].wait_event_ids == (before.id,)
    assert recording.launches[-1].signal_event_id == after.id
    recording.destroy_all([stream, before, after])
    destroy_bindings(recording, bindings)


# ----- CPU and CUDA: real numbers -----------------------------------------------------------


@pytest.mark.parametrize("streams", [(None, None, None, None), (0, 0, 1, 0), (0, 1, 2, 1)])
async def test_diamond_computes_the_right_numbers(
    executing_backend: accy.Backend, streams: tuple[int | None, ...]
) -> None:
    backend = executing_backend
    bindings = bind_all(backend, SIZES)
    async with await load_kernels(backend, chain_plan(backend)) as kernels:
        for _ in range(3):
            backend.fill_buffer(bindings[3].binding.handle, 0)
            run = await launch_graph(kernels, bindings, diamond(streams))  # type: ignore[arg-type]
            await run.wait()
            got = await read_f32(backend, bindings[3])
            np.testing.assert_array_equal(got, np.full(N, 3.0 + 4.0, np.float32))
    destroy_bindings(backend, bindings)


@pytest.mark.parametrize("trips", range(1, 10))
async def test_a_loop_carries_its_buffer_through_each_iteration(
    executing_backend: accy.Backend, trips: int
) -> None:
    backend = executing_backend
    bindings = bind_all(backend, SIZES)
    by_slot = {b.slot_id: b for b in bindings}
    graph = ping_pong(trips)
    async with await load_kernels(backend, chain_plan(backend)) as kernels:
        await (await launch_graph(kernels, bindings, graph)).wait()
    final = by_slot[6] if trips % 2 else by_slot[1]
    np.testing.assert_array_equal(
        await read_f32(backend, final), np.full(N, 3.0 + trips, np.float32)
    )
    destroy_bindings(backend, bindings)


# ----- the bindings of a run, checked each run -----------------------------------------------


@pytest.mark.parametrize("device_graph", [False, True])
async def test_a_relaunch_with_the_same_bindings_still_refuses_a_destroyed_buffer(
    recording: accy.RecordingBackend, device_graph: bool
) -> None:
    """A relaunch checks its slots again: the slot of the destroyed buffer is named."""
    bindings = bind_all(recording, SIZES)
    graph = diamond((0, 0, 1, 0))
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        for _ in range(2):
            await (await launch_graph(kernels, bindings, graph, device_graph=device_graph)).wait()
        launches = len(recording.launches)
        gone = next(b for b in bindings if b.slot_id == 3)
        recording.destroy(gone.binding.handle)
        with pytest.raises(accy.InvalidBuffer, match="not a live buffer") as raised:
            await launch_graph(kernels, bindings, graph, device_graph=device_graph)
        assert raised.value.message.startswith("slot 3: ")
        assert raised.value.path == "$.slot_bindings"
        assert len(recording.launches) == launches  # nothing enqueued
        fresh = SlotBinding(3, recording.allocate_buffer(SIZES[3]).bind())
        rebound = [fresh if b.slot_id == 3 else b for b in bindings]
        await (await launch_graph(kernels, rebound, graph, device_graph=device_graph)).wait()
        assert len(recording.launches) == launches + 4
    destroy_bindings(recording, rebound)


@pytest.mark.parametrize("device_graph", [False, None])
async def test_a_relaunch_through_unloaded_kernels_is_refused(
    recording: accy.RecordingBackend, device_graph: bool | None
) -> None:
    bindings = bind_all(recording, SIZES)
    graph = diamond((None, None, None, None))
    kernels = await load_kernels(recording, chain_plan(recording))
    for _ in range(2):
        await (await launch_graph(kernels, bindings, graph, device_graph=device_graph)).wait()
    launches = len(recording.launches)
    recording.destroy(kernels.loaded[2])
    with pytest.raises(accy.InvalidArtifact, match=r"not loaded|not a live artifact"):
        await launch_graph(kernels, bindings, graph, device_graph=device_graph)
    assert len(recording.launches) == launches
    await accy.wait_stream(recording)
    recording.destroy_all(kernels.device_graphs.take_all())
    recording.destroy_all([each for i, each in enumerate(kernels.loaded) if i != 2])
    destroy_bindings(recording, bindings)


@pytest.mark.parametrize("device_graph", [False, True])
async def test_a_slot_bound_to_nothing_or_to_something_else_is_named(
    recording: accy.RecordingBackend, device_graph: bool
) -> None:
    bindings = bind_all(recording, SIZES)
    slots: dict[int, object] = {b.slot_id: b.binding for b in bindings}
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        for wrong, message in ((None, "slot 2 has no buffer bound"), (7, "bound to a int")):
            slots[2] = wrong
            with pytest.raises(accy.InvalidBuffer, match=message):
                await launch_graph(
                    kernels,
                    slots,  # type: ignore[arg-type]
                    diamond((None, None, None, None)),
                    device_graph=device_graph,
                )
            with pytest.raises(accy.InvalidBuffer, match=message):
                kernels.launch_kernel(1, slots)  # type: ignore[arg-type]
    assert recording.launch_count == 0
    destroy_bindings(recording, bindings)


async def test_a_binding_gives_the_same_view_for_an_access_mode_each_time(
    recording: accy.RecordingBackend,
) -> None:
    buffer = recording.allocate_buffer(64)
    binding = buffer.bind(offset=16)
    view = binding.with_access("read_only")
    assert view is binding.with_access("read_only") and view is not binding
    assert (view.access, view.offset, view.byte_size, view.address) == (
        "read_only",
        16,
        48,
        binding.address,
    )
    assert binding.with_access("read_write") is binding
    recording.destroy(buffer)
