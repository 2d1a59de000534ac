"""Instantiated kernel graphs: made once, launched as one submission with new arguments.

On every backend (CUDA where there is a GPU): results equal eager launches, only
changed nodes are patched, bad input is refused before the device is asked,
launches of one graph from two streams run in order, nothing leaks, and faults
injected into instantiation and launch leave nothing behind.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async.backends import Backend, GraphNode, RecordingBackend

from .kernels import grid_for, load

N = 1000


async def _diamond(backend: Backend) -> tuple[list[GraphNode], list[accy.LoadedArtifact]]:
    """iota -> (copy, add_one) -> add: four nodes, two in parallel."""
    iota = await load(backend, "iota_f32")
    copy = await load(backend, "copy_f32")
    add_one = await load(backend, "add_one_f32")
    add = await load(backend, "add_f32")
    config = accy.LaunchConfig(*grid_for(N))
    nodes = [
        GraphNode(iota, config),
        GraphNode(copy, config, after=(0,)),
        GraphNode(add_one, config, after=(0,)),
        GraphNode(add, config, after=(1, 2)),
    ]
    return nodes, [iota, copy, add_one, add]


def _arguments(
    buffers: list[accy.BufferHandle], base: float
) -> list[tuple[list[accy.BufferBinding], list[accy.ScalarArgument]]]:
    x, y, z, out = (b.bind() for b in buffers)
    n = accy.U32(N)
    return [
        ([x], [n, accy.F32(base)]),
        ([y, x], [n]),
        ([z, x], [n]),
        ([out, y, z], [n]),
    ]


async def _read(backend: Backend, buffer: accy.BufferHandle) -> np.ndarray:
    return np.frombuffer(await accy.wait_read(backend.enqueue_read(buffer)), np.float32)


async def test_a_graph_computes_what_eager_launches_do_and_patches_new_arguments(
    backend: Backend,
) -> None:
    nodes, kernels = await _diamond(backend)
    graph = backend.instantiate_graph(nodes)
    assert backend.live_objects()[graph.id] == "graph"
    first = [backend.allocate_buffer(4 * N) for _ in range(4)]
    second = [backend.allocate_buffer(4 * N) for _ in range(4)]
    stream = backend.create_stream()
    backend.launch_graph_exec(graph, _arguments(first, 1.0), stream=stream)
    backend.launch_graph_exec(graph, _arguments(second, 5.0), stream=stream)
    backend.launch_graph_exec(graph, _arguments(second, 5.0), stream=stream)  # nothing changed
    await accy.wait_stream(backend, stream)
    if backend.kind != "recording":
        iota = np.arange(N, dtype=np.float32)
        np.testing.assert_array_equal(await _read(backend, first[3]), 2 * (iota + 1) + 1)
        np.testing.assert_array_equal(await _read(backend, second[3]), 2 * (iota + 5) + 1)
    else:
        assert isinstance(backend, RecordingBackend)
        assert [graph_id for graph_id, _ in backend.graph_launches] == [graph.id] * 3
    backend.destroy_all([graph, stream, *first, *second, *kernels])
    assert not backend.live_handles()


async def test_launches_of_one_graph_from_two_streams_run_one_after_the_other(
    executing_backend: Backend,
) -> None:
    backend = executing_backend
    slow = await load(backend, "slow_fill_f32")
    add_one = await load(backend, "add_one_f32")
    config = accy.LaunchConfig(*grid_for(N))
    graph = backend.instantiate_graph([GraphNode(add_one, config)])
    data = backend.allocate_buffer(4 * N)
    first, second = backend.create_stream(), backend.create_stream()
    n = accy.U32(N)
    backend.launch(slow, [data.bind()], [n, accy.F32(10.0), accy.U64(20_000_000)], config,
                   stream=first)  # fmt: skip
    backend.launch_graph_exec(graph, [([data.bind(), data.bind()], [n])], stream=first)
    backend.launch_graph_exec(graph, [([data.bind(), data.bind()], [n])], stream=second)
    await accy.wait_stream(backend, second)
    await accy.wait_stream(backend, first)
    np.testing.assert_array_equal(await _read(backend, data), np.full(N, 12.0, np.float32))
    backend.destroy_all([graph, data, first, second, slow, add_one])


async def test_graphs_of_kernels_prepared_for_graphs_compute_what_eager_launches_do(
    backend: Backend,
) -> None:
    # Prepared, CUDA nodes read their arguments from the graph's device table: each launch
    # with new arguments rewrites it, so every other launch here changes every node's.
    nodes, kernels = await _diamond(backend)
    await backend.prepare_graph_kernels(kernels)
    graph = backend.instantiate_graph(nodes)
    if backend.kind == "cuda":
        assert all(node.table_offset >= 0 for node in graph.native.nodes)
    sets = [[backend.allocate_buffer(4 * N) for _ in range(4)] for _ in range(3)]
    stream = backend.create_stream()
    for turn in range(9):
        backend.launch_graph_exec(graph, _arguments(sets[turn % 3], float(turn)), stream=stream)
    await accy.wait_stream(backend, stream)
    if backend.kind != "recording":
        iota = np.arange(N, dtype=np.float32)
        for index, base in enumerate((6.0, 7.0, 8.0)):  # each set's last launch
            np.testing.assert_array_equal(
                await _read(backend, sets[index][3]), 2 * (iota + base) + 1
            )
    backend.destroy_all([graph, stream, *(b for each in sets for b in each), *kernels])
    assert not backend.live_handles()


async def test_a_prepared_graph_launched_from_another_stream_keeps_each_launchs_arguments(
    executing_backend: Backend,
) -> None:
    # The first launch waits behind a 20 ms kernel; the second, from another stream, must
    # not rewrite the table the first has not read yet (each writes its own output).
    backend = executing_backend
    slow = await load(backend, "slow_fill_f32")
    add_one = await load(backend, "add_one_f32")
    await backend.prepare_graph_kernels([add_one])
    config = accy.LaunchConfig(*grid_for(N))
    graph = backend.instantiate_graph([GraphNode(add_one, config)])
    data, a, b = (backend.allocate_buffer(4 * N) for _ in range(3))
    first, second = backend.create_stream(), backend.create_stream()
    n = accy.U32(N)
    backend.launch(slow, [data.bind()], [n, accy.F32(10.0), accy.U64(20_000_000)], config,
                   stream=first)  # fmt: skip
    backend.launch_graph_exec(graph, [([a.bind(), data.bind()], [n])], stream=first)
    backend.launch_graph_exec(graph, [([b.bind(), data.bind()], [n])], stream=second)
    await accy.wait_stream(backend, second)
    await accy.wait_stream(backend, first)
    for out in (a, b):
        np.testing.assert_array_equal(await _read(backend, out), np.full(N, 11.0, np.float32))
    backend.destroy_all([graph, data, a, b, first, second, slow, add_one])


async def test_a_prepared_graph_launches_on_after_the_stream_of_its_last_launch_is_gone(
    executing_backend: Backend,
) -> None:
    # Launch graphs on streams of their own destroy them after each run; the graph stays.
    backend = executing_backend
    add_one = await load(backend, "add_one_f32")
    await backend.prepare_graph_kernels([add_one])
    config = accy.LaunchConfig(*grid_for(N))
    graph = backend.instantiate_graph([GraphNode(add_one, config)])
    source = accy.upload(backend, np.arange(N, dtype=np.float32))
    outs = [backend.allocate_buffer(4 * N) for _ in range(3)]
    n = accy.U32(N)
    for out in outs:
        stream = backend.create_stream()
        backend.launch_graph_exec(graph, [([out.bind(), source.bind()], [n])], stream=stream)
        await accy.wait_stream(backend, stream)
        backend.destroy(stream)
    for out in outs:
        np.testing.assert_array_equal(await _read(backend, out), np.arange(N, dtype=np.float32) + 1)
    backend.destroy_all([graph, source, *outs, add_one])


async def test_tasks_preparing_the_same_kernels_at_once_make_each_variant_once(
    backend: Backend,
) -> None:
    kernels = [await load(backend, name) for name in ("add_one_f32", "copy_f32")]
    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(backend.prepare_graph_kernels, kernels)
    if backend.kind == "cuda":
        from accy_async.backends.cuda._launch import TableKernel

        assert all(isinstance(kernel.native.table, TableKernel) for kernel in kernels)
    backend.destroy_all(kernels)
    assert not backend.live_handles()


async def test_preparing_kernels_for_graphs_is_a_checkpoint_and_refuses_dead_artifacts(
    backend: Backend,
) -> None:
    kernel = await load(backend, "add_one_f32")
    with anyio.CancelScope() as scope:
        scope.cancel()
        await backend.prepare_graph_kernels([kernel])
    assert scope.cancelled_caught
    await backend.prepare_graph_kernels([kernel])
    await backend.prepare_graph_kernels([kernel])  # once made, nothing more to do
    backend.destroy(kernel)
    with pytest.raises(accy.InvalidArtifact, match=r"loaded\[0\]"):
        await backend.prepare_graph_kernels([kernel])


async def test_bad_graphs_and_arguments_are_refused_before_the_device_is_asked(
    backend: Backend,
) -> None:
    nodes, kernels = await _diamond(backend)
    with pytest.raises(accy.LaunchArgumentMismatch, match="at least one node"):
        backend.instantiate_graph([])
    with pytest.raises(accy.LaunchArgumentMismatch, match=r"nodes\[1\]\.after"):
        backend.instantiate_graph([nodes[0], GraphNode(kernels[1], nodes[1].config, after=(1,))])
    graph = backend.instantiate_graph(nodes)
    buffers = [backend.allocate_buffer(4 * N) for _ in range(4)]
    good = _arguments(buffers, 0.0)
    with pytest.raises(accy.LaunchArgumentMismatch, match="4 nodes"):
        backend.launch_graph_exec(graph, good[:3])
    with pytest.raises(accy.LaunchArgumentMismatch, match=r"arguments\[1\]"):
        backend.launch_graph_exec(graph, [good[0], (good[1][0], []), *good[2:]])
    small = backend.allocate_buffer(16)
    with pytest.raises(accy.InvalidBuffer, match=r"arguments\[0\]\.buffers"):
        backend.launch_graph_exec(graph, [([small.bind(offset=32, byte_size=4)], good[0][1]),
                                          *good[1:]])  # fmt: skip
    backend.destroy(kernels[3])
    with pytest.raises(accy.InvalidArtifact, match="node 3"):
        backend.launch_graph_exec(graph, good)
    with pytest.raises(accy.InvalidArtifact, match=r"nodes\[3\]\.loaded"):
        backend.instantiate_graph(nodes)
    backend.destroy(graph)
    with pytest.raises(accy.InvalidBuffer, match="not a live graph"):
        backend.launch_graph_exec(graph, good)
    backend.destroy_all([small, *buffers, *kernels[:3]])
    assert not backend.live_handles()


async def test_injected_graph_faults_leave_nothing_behind() -> None:
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        nodes, kernels = await _diamond(backend)
        buffers = [backend.allocate_buffer(4 * N) for _ in range(4)]
        before = dict(backend.live_objects())
        backend.inject_fault("instantiate")
        with pytest.raises(accy.RuntimeUnavailable):
            backend.instantiate_graph(nodes)
        assert backend.live_objects() == before
        graph = backend.instantiate_graph(nodes)
        backend.inject_fault("graph_launch")
        with pytest.raises(accy.RuntimeUnavailable):
            backend.launch_graph_exec(graph, _arguments(buffers, 0.0))
        assert not backend.launches  # no node ran
        backend.launch_graph_exec(graph, _arguments(buffers, 0.0))
        assert len(backend.launches) == len(nodes)
        assert backend.faults_fired("instantiate") == backend.faults_fired("graph_launch") == 1
        backend.destroy_all([graph, *buffers, *kernels])
        assert not backend.live_handles()
