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

import numpy as np
import pytest

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.backends import RecordingBackend
from accy_async.pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    launch_pipeline,
    load_pipeline_artifacts,
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
        for mode in (False, True, None):
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
            for _ in range(3):  # the automatic choice makes a graph from the second launch
                await launch_pipeline(backend, request)
            await accy.wait_stream(backend, stream)
            got[mode] = bytes(await accy.wait_read(backend.enqueue_read(result, stream=stream)))
            backend.destroy(result)
        assert len(pool.graphs)  # made with graph=True at least
        if backend.kind == "cuda":  # every built-in kernel reads its arguments from the table
            from accy_async.backends.cuda._launch import TableKernel

            tables = [entry.loaded.native.table for entry in pool.entries]
            assert all(isinstance(table, TableKernel) for table in tables), tables
    assert got[True] == got[False] == got[None]
    backend.destroy_all([stream, *operands])
    assert not backend.live_handles()


async def _scan_pool(
    backend: accy.Backend, name: str = "prefix_sum_i32"
) -> tuple[p.PipelineDocument, Any, Any, list[accy.BufferHandle]]:
    document = library.load_builtin(name)
    scalars = _scalars(name, N)
    pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry)
    scratch = await allocate_pipeline_intermediates(backend, document.pipeline, scalars)
    buffers = [backend.allocate_buffer(4 * N) for _ in range(len(document.operands) + 1)]
    return document, pool, scratch, buffers


def _request(
    document: p.PipelineDocument, pool: Any, scratch: Any, buffers: list[accy.BufferHandle],
    graph: bool | None, name: str = "prefix_sum_i32",
) -> PipelineLaunch:  # fmt: skip
    return PipelineLaunch.of(
        document,
        operands=tuple(b.bind("read_only") for b in buffers[:-1]),
        results=(buffers[-1].bind(),),
        runtime_scalar_arguments=_scalars(name, N),
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


async def test_new_requests_go_stage_by_stage_unless_asked() -> None:
    """A service's every request is new (of varied sizes): no graph unless asked for."""
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, RecordingBackend)
        document, pool, scratch, buffers = await _scan_pool(backend)
        for _ in range(4):
            await launch_pipeline(backend, _request(document, pool, scratch, buffers, None))
        assert not backend.graph_launches and not len(pool.graphs)
        for _ in range(2):
            await launch_pipeline(backend, _request(document, pool, scratch, buffers, True))
        assert len(backend.graph_launches) == 2 and len(pool.graphs) == 1
        await pool.aclose()
        await scratch.aclose()
        backend.destroy_all(buffers)
        assert not backend.live_handles()
