"""Launch graphs as one device graph: the same numbers as node by node, chosen as documented.

The diamond on one, two and three streams and the ping-pong loop give the same
buffers both ways on every executing backend; a launch graph relaunched
through the same kernels goes as one graph (``device_graph=None``), always
with ``True``, never with ``False``; what cannot be one graph is refused or
launched node by node; faults leave nothing behind.
"""

from __future__ import annotations

import numpy as np
import pytest

import accy_async as accy
from accy_async import plan as p
from accy_async.graph import launch_graph
from accy_async.kernels import load_kernels
from accy_async.testing import live_after_drain

from .plans import CHAIN_SIZES, bind_all, chain_plan, destroy_bindings, diamond
from .test_graph import ping_pong, read_f32

GRAPHS = {
    "diamond, host order": diamond((None, None, None, None)),
    "diamond, two streams": diamond((0, 0, 1, 0)),
    "diamond, three streams": diamond((0, 1, 2, 1)),
    "ping-pong, 1 trip": ping_pong(1),
    "ping-pong, 4 trips, then a node": ping_pong(4, then=(1,)),
    "ping-pong, 7 trips": ping_pong(7),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
async def test_a_launch_graph_gives_the_same_numbers_as_one_device_graph(
    executing_backend: accy.Backend, name: str
) -> None:
    backend = executing_backend
    graph = GRAPHS[name]
    got: dict[bool, list[np.ndarray]] = {}
    async with await load_kernels(backend, chain_plan(backend)) as kernels:
        for device_graph in (False, True):
            bindings = bind_all(backend, CHAIN_SIZES)
            for binding in bindings:
                backend.fill_buffer(binding.binding.handle, 0)
            await accy.wait_stream(backend)  # the fills land before any stream of the graph runs
            for _ in range(2):  # a relaunch patches nothing on CUDA
                run = await launch_graph(kernels, bindings, graph, device_graph=device_graph)
                await run.wait()
                assert all(run.node(i).done for i in range(len(graph.nodes)))
            got[device_graph] = [await read_f32(backend, binding) for binding in bindings]
            destroy_bindings(backend, bindings)
        assert len(kernels.device_graphs) == 1
    for eager, as_graph in zip(got[False], got[True], strict=True):
        np.testing.assert_array_equal(eager, as_graph)
    assert await live_after_drain(backend) == {}


async def test_new_buffers_each_run_are_patched_in(executing_backend: accy.Backend) -> None:
    backend = executing_backend
    graph = ping_pong(3)
    async with await load_kernels(backend, chain_plan(backend)) as kernels:
        for _ in range(3):
            bindings = bind_all(backend, CHAIN_SIZES)
            await (await launch_graph(kernels, bindings, graph, device_graph=True)).wait()
            by_slot = {b.slot_id: b for b in bindings}
            np.testing.assert_array_equal(
                await read_f32(backend, by_slot[6]), np.full(len(await read_f32(
                    backend, by_slot[6])), 6.0, np.float32)
            )  # fmt: skip
            destroy_bindings(backend, bindings)
        assert len(kernels.device_graphs) == 1


@pytest.mark.parametrize(("device_graph", "graph_launches"), [(None, 2), (True, 3), (False, 0)])
async def test_which_runs_go_as_one_graph(
    recording: accy.RecordingBackend, device_graph: bool | None, graph_launches: int
) -> None:
    bindings = bind_all(recording, CHAIN_SIZES)
    graph = diamond((0, 0, 1, 0))  # one plan, launched again: the same schedule
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        for _ in range(3):
            run = await launch_graph(kernels, bindings, graph, device_graph=device_graph)
            await run.wait()
            assert run.enqueued_launches == 4
    assert len(recording.graph_launches) == graph_launches
    assert len(recording.launches) == 12
    destroy_bindings(recording, bindings)
    assert await live_after_drain(recording) == {}


async def test_the_runs_other_streams_end_with_the_graph(recording: accy.RecordingBackend) -> None:
    bindings = bind_all(recording, CHAIN_SIZES)
    streams = [recording.create_stream(), recording.create_stream()]
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        run = await launch_graph(
            kernels, bindings, diamond((0, 0, 1, 0)), streams=streams, device_graph=True
        )
        await run.wait()
    ((_, stream_id),) = recording.graph_launches
    assert stream_id == streams[0].id
    end = [event for event, stream in recording.records if stream == streams[0].id][-1]
    assert (streams[1].id, end) in recording.waits
    recording.destroy_all(streams)
    destroy_bindings(recording, bindings)


async def test_what_cannot_be_one_graph_is_refused_or_runs_node_by_node(
    recording: accy.RecordingBackend,
) -> None:
    bindings = bind_all(recording, CHAIN_SIZES)
    external = recording.create_event()
    graph = p.LaunchGraphPlan(
        nodes=(p.GraphNode(kernel_index=0), p.GraphNode(kernel_index=1, signal_event=0)),
        event_count=1,
    )
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        with pytest.raises(accy.UnsupportedOperation, match="caller's events"):
            await launch_graph(kernels, bindings, graph, events=[external], device_graph=True)
        for _ in range(3):
            await (await launch_graph(kernels, bindings, graph, events=[external])).wait()
    assert not recording.graph_launches and len(recording.launches) == 6
    recording.destroy(external)
    destroy_bindings(recording, bindings)


@pytest.mark.parametrize("kind", ["instantiate", "graph_launch"])
async def test_a_graph_fault_raises_and_leaves_nothing_behind(
    recording: accy.RecordingBackend, kind: str
) -> None:
    bindings = bind_all(recording, CHAIN_SIZES)
    before = set(recording.live_objects())
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        recording.inject_fault(kind)  # type: ignore[arg-type]
        with pytest.raises(accy.RuntimeUnavailable):
            await launch_graph(kernels, bindings, diamond((0, 1, 2, 1)), device_graph=True)
        run = await launch_graph(kernels, bindings, diamond((0, 1, 2, 1)), device_graph=True)
        await run.wait()
    recording.collect_deferred()
    assert set(recording.live_objects()) == before  # streams, events, graphs, kernels: gone
    destroy_bindings(recording, bindings)


async def test_a_backend_without_graphs_runs_node_by_node_once_it_failed(
    recording: accy.RecordingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    bindings = bind_all(recording, CHAIN_SIZES)
    recording.inject_fault("instantiate", repeat=True)
    graph = diamond((0, 0, 1, 0))
    async with await load_kernels(recording, chain_plan(recording)) as kernels:
        for _ in range(3):
            await (await launch_graph(kernels, bindings, graph)).wait()
    assert recording.faults_fired("instantiate") == 1 and len(recording.launches) == 12
    assert sum("no graph" in record.message for record in caplog.records) == 1
    destroy_bindings(recording, bindings)
