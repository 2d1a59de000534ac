"""Pipelines as one graph: the same bytes as stage-by-stage launches, chosen as documented.

A request relaunched through a pool with its scratch goes to the device as one
instantiated graph (``device_graph=None``), always with ``True``, never with
``False``; results are identical on every executing backend for every
built-in pipeline; a backend that cannot make graphs falls back (and says so);
faults in instantiation and launch leave nothing behind.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.backends import RecordingBackend
from accy_async.pipeline import (
    PipelineIntermediates,
    PipelineLaunch,
    allocate_pipeline_intermediates,
    launch_pipeline,
    load_pipeline_artifacts,
    resolve_launch,
)

N = 10_007


def _scalars(name: str, n: int) -> tuple[p.ScalarArgument, ...]:
    return (p.U32(n), p.F32(2.5)) if name.startswith("saxpy") else (p.U32(n),)


def _inputs(document: p.PipelineDocument, n: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(n)
    arrays: list[np.ndarray[Any, Any]] = []
    for operand in document.operands:
        if operand.dtype is p.DType.I32:
            arrays.append(rng.integers(-1000, 1000, n, dtype=np.int32))
        else:
            arrays.append(rng.random(n, dtype=np.float32))
    return arrays


def _result_bytes(document: p.PipelineDocument, n: int) -> int:
    return sum(4 * p.resolve_quantity(result.extent, [p.U32(n)]) for result in document.results)


async def _result_of(
    backend: accy.Backend,
    document: p.PipelineDocument,
    scalars: Any,
    held: tuple[list[accy.BufferHandle], Any, Any, accy.StreamHandle],
    mode: bool | None,
    launches: int,
) -> bytes:
    """The result's bytes after ``launches`` launches of one new request into a new buffer.

    ``held``: the operands, pool, scratch and stream the request launches with.
    """
    operands, pool, scratch, stream = held
    result = backend.allocate_buffer(_result_bytes(document, N))
    request = PipelineLaunch.of(
        document,
        operands=tuple(b.bind("read_only") for b in operands),
        results=(result.bind(),),
        runtime_scalar_arguments=scalars,
        intermediates=scratch,
        artifacts=pool,
        stream=stream,
        device_graph=mode,
    )
    for _ in range(launches):
        await launch_pipeline(backend, request)
    await accy.wait_stream(backend, stream)
    got = bytes(await accy.wait_read(backend.enqueue_read(result, stream=stream)))
    backend.destroy(result)
    return got


@pytest.mark.parametrize("name", sorted(library.BUILTIN_PLANS))
async def test_every_builtin_pipeline_gives_the_same_bytes_as_one_graph(
    executing_backend: accy.Backend, name: str
) -> None:
    backend = executing_backend
    document = library.load_builtin(name)
    scalars = _scalars(name, N)
    stream = backend.create_stream()  # the uploads go on it too: in order with the launches
    operands = [accy.upload(backend, values, stream=stream) for values in _inputs(document, N)]
    got: dict[bool | None, bytes] = {}
    async with (
        await load_pipeline_artifacts(backend, document.pipeline, document.registry) as pool,
        await allocate_pipeline_intermediates(backend, document.pipeline, scalars) as scratch,
    ):
        held = (operands, pool, scratch, stream)
        for mode in (False, True, None):
            # The automatic choice makes a graph from the second launch.
            got[mode] = await _result_of(backend, document, scalars, held, mode, 3)
        assert len(pool.graphs)  # made with graph=True at least
        if backend.kind == "cuda":  # every built-in kernel reads its arguments from the table
            from accy_async.backends.cuda._launch import TableKernel

            tables = [entry.loaded.native.table for entry in pool.entries]
            assert all(isinstance(table, TableKernel) for table in tables), tables
    assert got[True] == got[False] == got[None]
    backend.destroy_all([stream, *operands])
    assert not backend.live_handles()


@pytest.mark.parametrize(
    "name",
    sorted(n for n in library.BUILTIN_PLANS if len(library.load_builtin(n).pipeline.stages) > 1),
)
async def test_new_requests_of_a_recurring_geometry_give_the_stage_by_stage_bytes(
    executing_backend: accy.Backend, name: str
) -> None:
    """The default's graph for new requests (new result buffers each time) computes what
    stage-by-stage launches do, from its first use on."""
    backend = executing_backend
    document = library.load_builtin(name)
    scalars = _scalars(name, N)
    stream = backend.create_stream()
    operands = [accy.upload(backend, values, stream=stream) for values in _inputs(document, N)]
    got: list[bytes] = []
    async with (
        await load_pipeline_artifacts(backend, document.pipeline, document.registry) as pool,
        await allocate_pipeline_intermediates(backend, document.pipeline, scalars) as scratch,
    ):
        held = (operands, pool, scratch, stream)
        for mode in (False, None, None, None):
            got.append(await _result_of(backend, document, scalars, held, mode, 1))  # noqa: PERF401
        assert len(pool.graphs) == 1  # the geometry recurred: the last two went as its graph
        assert pool.graphs.graphs[resolve_launch(pool, scalars).configs].last_stream is stream
    assert got[1:] == got[:1] * 3
    backend.destroy_all([stream, *operands])
    assert not backend.live_handles()


async def _scan_pool(
    backend: accy.Backend, name: str = "prefix_sum_i32", n: int = N
) -> tuple[p.PipelineDocument, Any, Any, list[accy.BufferHandle]]:
    document = library.load_builtin(name)
    scalars = _scalars(name, n)
    pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry)
    scratch = await allocate_pipeline_intermediates(backend, document.pipeline, scalars)
    buffers = [backend.allocate_buffer(4 * n) for _ in range(len(document.operands) + 1)]
    return document, pool, scratch, buffers


def _request(
    document: p.PipelineDocument, pool: Any, scratch: Any, buffers: list[accy.BufferHandle],
    graph: bool | None, name: str = "prefix_sum_i32", size: int = N,
) -> PipelineLaunch:  # fmt: skip
    return PipelineLaunch.of(
        document,
        operands=tuple(b.bind("read_only") for b in buffers[:-1]),
        results=(buffers[-1].bind(),),
        runtime_scalar_arguments=_scalars(name, size),
        intermediates=scratch,
        artifacts=pool,
        device_graph=graph,
    )


@pytest.mark.parametrize(
    ("name", "graph", "graph_launches"),
    [
        ("prefix_sum_i32", None, 2),  # relaunches only
        ("prefix_sum_i32", True, 3),
        ("prefix_sum_i32", False, 0),
        ("saxpy_f32", None, 0),  # one stage: nothing to gain
        ("saxpy_f32", True, 3),
    ],
)
async def test_which_launches_go_as_a_graph(
    name: str, graph: bool | None, graph_launches: int
) -> None:
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend, name)
        request = _request(document, pool, scratch, buffers, graph, name)
        for _ in range(3):
            await launch_pipeline(backend, request)
        assert len(backend.graph_launches) == graph_launches
        assert len(backend.launches) == 3 * len(document.pipeline.stages)
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all(buffers)
        assert not backend.live_handles()  # the pool's graphs went with it


async def test_a_backend_that_cannot_make_graphs_falls_back_once_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend)
        backend.inject_fault("instantiate", repeat=True)
        request = _request(document, pool, scratch, buffers, None)
        with caplog.at_level(logging.WARNING, logger="accy_async"):
            for _ in range(4):
                await launch_pipeline(backend, request)
        stages = len(document.pipeline.stages)
        assert len(backend.launches) == 4 * stages and not backend.graph_launches
        assert backend.faults_fired("instantiate") == 1  # asked once, then not again
        assert [r.message for r in caplog.records if "no graph" in r.message] != []
        assert len([r for r in caplog.records if "no graph" in r.message]) == 1
        with pytest.raises(accy.RuntimeUnavailable):  # asked for, a graph that fails raises
            await launch_pipeline(backend, _request(document, pool, scratch, buffers, True))
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all(buffers)
        assert not backend.live_handles()


async def test_a_failed_graph_launch_raises_and_the_next_one_runs() -> None:
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend)
        request = _request(document, pool, scratch, buffers, None)
        await launch_pipeline(backend, request)
        backend.inject_fault("graph_launch")
        with pytest.raises(accy.RuntimeUnavailable):
            await launch_pipeline(backend, request)
        await launch_pipeline(backend, request)
        assert len(backend.graph_launches) == 1
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all(buffers)
        assert not backend.live_handles()


async def test_a_pool_keeps_a_bounded_number_of_graphs() -> None:
    from accy_async._graph_cache import GRAPH_CAPACITY

    async with accy.open_backend("recording") as backend:
        document = library.load_builtin("prefix_sum_i32_three_stage")
        sizes = [256 * (k + 1) for k in range(GRAPH_CAPACITY + 3)]  # a grid each
        pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry)
        scratch = await allocate_pipeline_intermediates(
            backend, document.pipeline, (p.U32(max(sizes)),)
        )
        x, y = backend.allocate_buffer(4 * max(sizes)), backend.allocate_buffer(4 * max(sizes))
        for n in sizes:  # each size is another geometry
            request = PipelineLaunch.of(
                document, operands=(x.bind("read_only"),), results=(y.bind(),),
                runtime_scalar_arguments=(p.U32(n),), intermediates=scratch, artifacts=pool,
                device_graph=True,
            )  # fmt: skip
            await launch_pipeline(backend, request)
        await accy.wait_stream(backend)
        backend.collect_deferred()
        assert len(pool.graphs) == GRAPH_CAPACITY
        live_graphs = [kind for kind in backend.live_objects().values() if kind == "graph"]
        assert len(live_graphs) == GRAPH_CAPACITY  # the evicted ones were destroyed
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([x, y])
        assert not backend.live_handles()


async def test_new_requests_of_a_recurring_geometry_go_as_a_graph() -> None:
    """A new request's first geometry goes stage by stage; one the pool launched before, as
    a graph; a service whose every request has a new size never makes one unless asked."""
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        tile = 12_288  # the scan's elements per block: each multiple is a geometry of its own
        document, pool, scratch, buffers = await _scan_pool(backend, n=8 * tile)
        assert pool.graphs.prepared  # readied when loaded: a first graph waits for nothing
        stages = len(document.pipeline.stages)
        sizes = [k * tile for k in range(2, 9)]  # N (below a tile) is of the first
        assert len({resolve_launch(pool, _scalars("prefix_sum_i32", n)).configs
                    for n in [*sizes, N]}) == 8  # fmt: skip
        for size in sizes:  # every request of a new geometry: a graph would not pay
            request = _request(document, pool, scratch, buffers, None, size=size)
            await launch_pipeline(backend, request)
        assert not backend.graph_launches and not len(pool.graphs)
        assert len(backend.launches) == len(sizes) * stages
        for _ in range(3):  # new requests, one size: from the second, one graph
            await launch_pipeline(backend, _request(document, pool, scratch, buffers, None))
        assert len(backend.graph_launches) == 2 and len(pool.graphs) == 1
        assert len(backend.launches) == (len(sizes) + 3) * stages
        await launch_pipeline(backend, _request(document, pool, scratch, buffers, False))
        assert len(backend.graph_launches) == 2  # False: stage by stage, always
        for _ in range(2):
            await launch_pipeline(backend, _request(document, pool, scratch, buffers, True))
        assert len(backend.graph_launches) == 4 and len(pool.graphs) == 1
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all(buffers)
        assert not backend.live_handles()


async def test_a_new_request_neither_evicts_a_graph_nor_takes_one_of_another_stream() -> None:
    """Launches of one graph run one after the other: a new request keeps to the stream its
    geometry's graph runs on (other streams go stage by stage, concurrently), and a cache
    that is full is left as it is (a service cycling through sizes would rebuild graphs)."""
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        tile = 12_288
        document, pool, scratch, buffers = await _scan_pool(backend, n=4 * tile)
        pool.graphs.capacity = 1
        first, second = backend.create_stream(), backend.create_stream()

        def on(stream: accy.StreamHandle, size: int = N) -> PipelineLaunch:
            request = _request(document, pool, scratch, buffers, None, size=size)
            return msgspec.structs.replace(request, stream=stream)

        for _ in range(2):
            await launch_pipeline(backend, on(first))
        assert len(backend.graph_launches) == 1  # the geometry's second request
        for _ in range(2):
            await launch_pipeline(backend, on(second))
        assert len(backend.graph_launches) == 1  # its graph runs on the first stream
        await launch_pipeline(backend, on(first))
        assert len(backend.graph_launches) == 2
        for _ in range(3):  # a geometry that recurs, but the cache is full
            await launch_pipeline(backend, on(first, 2 * tile))
        assert len(backend.graph_launches) == 2 and len(pool.graphs) == 1
        for stream in (first, second):
            await accy.wait_stream(backend, stream)
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([*buffers, first, second])
        assert not backend.live_handles()


async def test_a_scratch_set_built_by_hand_that_repeats_a_buffer_is_refused() -> None:
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend)
        sizes = resolve_launch(pool, _scalars("prefix_sum_i32", N)).intermediate_sizes
        big = backend.allocate_buffer(max(sizes))
        twice = PipelineIntermediates(backend, [big.bind() for _ in sizes])
        request = msgspec.structs.replace(
            _request(document, pool, scratch, buffers, None), intermediates=twice
        )
        assert len(sizes) == 2
        with pytest.raises(accy.LaunchArgumentMismatch, match="aliases intermediate 0"):
            await launch_pipeline(backend, request)
        assert not backend.launches
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([*buffers, big])
        assert not backend.live_handles()


async def test_a_graph_whose_stream_was_destroyed_serves_new_requests_on_others() -> None:
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend)
        worker = backend.create_stream()
        for _ in range(2):
            request = _request(document, pool, scratch, buffers, None)
            await launch_pipeline(backend, msgspec.structs.replace(request, stream=worker))
        assert len(backend.graph_launches) == 1
        await accy.wait_stream(backend, worker)
        backend.destroy(worker)
        for _ in range(2):  # on the default stream: the graph's stream is gone
            await launch_pipeline(backend, _request(document, pool, scratch, buffers, None))
        assert len(backend.graph_launches) == 3
        await accy.wait_stream(backend)
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all(buffers)
        assert not backend.live_handles()


@pytest.mark.parametrize("evict", [False, True])
async def test_launches_deciding_together_keep_the_graph_rules_across_a_prepare(
    evict: bool,
) -> None:
    """A launch that awaits the pool's preparation decides again after it: two streams do
    not share one graph, and a new request does not evict one from a full cache."""
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        tile = 12_288
        document, pool, scratch, buffers = await _scan_pool(backend, n=4 * tile)
        pool.graphs.prepared = False  # as if not readied at load: the first graph awaits it
        a, b = backend.create_stream(), backend.create_stream()

        def on(stream: accy.StreamHandle, size: int) -> PipelineLaunch:
            request = _request(document, pool, scratch, buffers, None, size=size)
            return msgspec.structs.replace(request, stream=stream)

        if evict:
            pool.graphs.capacity = 1
            jobs = [(a, tile), (a, 2 * tile)]  # two geometries, each sighted once
            sighted = jobs
        else:
            jobs = [(a, tile), (b, tile)]  # one geometry, two streams
            sighted = jobs[:1]
        for stream, size in sighted:
            await launch_pipeline(backend, on(stream, size))
        async with anyio.create_task_group() as group:
            for stream, size in jobs:
                group.start_soon(launch_pipeline, backend, on(stream, size))
        assert len(backend.graph_launches) == 1, backend.graph_launches
        assert len(pool.graphs) == 1 and not backend.destroyed_ids
        for stream in (a, b):
            await accy.wait_stream(backend, stream)
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([*buffers, a, b])
        assert not backend.live_handles()


async def test_an_adopted_stream_forgotten_during_a_prepare_is_adopted_again() -> None:
    raw = 0xABC0  # a foreign stream's raw handle (the recording backend adopts any)
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend)
        pool.graphs.prepared = False  # the launch below awaits the preparation
        entered = anyio.Event()
        prepare = backend.prepare_graph_kernels

        async def slow_prepare(loaded: Any) -> None:
            entered.set()
            await anyio.sleep(0.01)
            await prepare(loaded)

        backend.prepare_graph_kernels = slow_prepare  # type: ignore[method-assign]

        async def forget() -> None:
            await entered.wait()
            backend.destroy(backend.adopt_stream(raw))

        request = msgspec.structs.replace(
            _request(document, pool, scratch, buffers, True), stream=raw
        )
        async with anyio.create_task_group() as group:
            group.start_soon(forget)
            await launch_pipeline(backend, request)
        ((_, stream_id),) = backend.graph_launches
        adopted = backend.adopt_stream(raw)
        assert stream_id == adopted.id and backend.owns(adopted)
        await accy.wait_stream(backend, adopted)
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([*buffers, adopted])
        assert not backend.live_handles()


async def test_a_new_request_like_a_packed_one_keeps_the_graph_rules_of_new_requests() -> None:
    """Relaunched from a pack made while the graph was its stream's, a new request like it
    still does not take the graph once another stream's launch has it."""
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend)
        first, second = backend.create_stream(), backend.create_stream()

        def on(stream: accy.StreamHandle, graph: bool | None = None) -> PipelineLaunch:
            request = _request(document, pool, scratch, buffers, graph)
            return msgspec.structs.replace(request, stream=stream)

        for _ in range(3):  # the second packed with the graph, the third relaunched from it
            await launch_pipeline(backend, on(first))
        assert len(backend.graph_launches) == 2
        await launch_pipeline(backend, on(second, True))  # asks for the graph: takes it
        assert len(backend.graph_launches) == 3
        before = len(backend.launches)
        await launch_pipeline(backend, on(first))  # like the packed one: stage by stage
        assert len(backend.graph_launches) == 3
        assert len(backend.launches) == before + len(document.pipeline.stages)
        await accy.wait_stream(backend, second)
        backend.destroy(second)  # the graph's stream is gone: free for a new request again
        await launch_pipeline(backend, on(first))
        assert len(backend.graph_launches) == 4
        await accy.wait_stream(backend, first)
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all([*buffers, first])
