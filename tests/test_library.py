"""The built-in kernels computed for real, against NumPy, on every executing backend."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    launch_pipeline,
    load_pipeline_artifacts,
)

from .conftest import needs_gpu

TILE = 256 * 12 * 4
SIZES = [1, 63, 64, 65, 3073, 4096, TILE - 1, TILE + 1, 32 * TILE, 32 * TILE + 1, 65 * TILE + 7]
SIZES += [10**6 + 3]
"""Around the tiles (64 to 12,288 elements), a look-back window (32 tiles), and past both."""
METHODS: list[library.ScanMethod] = ["single_pass", "three_stage"]


def wrapped_cumsum(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The inclusive sum of 32-bit integers as the device computes it: 64-bit sums, wrapped."""
    return np.cumsum(values.astype(np.int64)).astype(values.dtype)


def fmt_of(backend: accy.Backend) -> p.ArtifactFormat:
    return backend.preferred_formats[0] if backend.kind != "cuda" else p.ArtifactFormat.CUDA_SOURCE


async def run_document(
    backend: accy.Backend,
    document: p.PipelineDocument,
    inputs: list[np.ndarray[Any, Any]],
    scalars: tuple[p.ScalarArgument, ...],
    result_dtype: Any,
    result_count: int,
) -> np.ndarray[Any, Any]:
    operands = [accy.upload(backend, values) for values in inputs]
    result = backend.allocate_buffer(max(1, result_count * np.dtype(result_dtype).itemsize))
    try:
        await launch_pipeline(
            backend,
            PipelineLaunch(
                pipeline=document.pipeline,
                registry=document.registry,
                format=fmt_of(backend),
                operands=[b.bind("read_only") for b in operands],
                results=[result.bind()],
                runtime_scalar_arguments=scalars,
            ),
        )
        return await accy.download(backend, result, result_dtype, result_count)
    finally:
        backend.destroy_all([*operands, result])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [64, 256])
@pytest.mark.parametrize("method", METHODS)
async def test_prefix_sum_matches_numpy_exactly_on_integers(
    executing_backend: accy.Backend, n: int, block: int, method: library.ScanMethod
) -> None:
    rng = np.random.default_rng(n)
    values = rng.integers(-(2**31), 2**31, n, dtype=np.int32)  # sums wrap, as int32 does
    document = library.prefix_sum(p.DType.I32, block, method=method)
    got = await run_document(executing_backend, document, [values], (p.U32(n),), np.int32, n)
    np.testing.assert_array_equal(got, wrapped_cumsum(values))


@pytest.mark.parametrize("n", [4096 * 5 + 3, 10**6 + 3])
@pytest.mark.parametrize("vectors", [1, 3, 8])
async def test_the_single_pass_scan_takes_any_rows_per_thread_and_unsigned_integers(
    executing_backend: accy.Backend, n: int, vectors: int
) -> None:
    values = np.random.default_rng(vectors).integers(0, 2**32, n, dtype=np.uint32)
    document = library.prefix_sum(p.DType.U32, 128, method="single_pass", vectors=vectors)
    got = await run_document(executing_backend, document, [values], (p.U32(n),), np.uint32, n)
    np.testing.assert_array_equal(got, wrapped_cumsum(values))


async def test_the_single_pass_scan_reads_and_writes_unaligned_arrays(
    executing_backend: accy.Backend,
) -> None:
    """Arrays 4 bytes past a 16-byte boundary: every tile goes element by element."""
    backend = executing_backend
    n = 3 * 4096 + 5
    values = np.random.default_rng(3).integers(-50, 50, n + 1, dtype=np.int32)
    document = library.load_builtin("prefix_sum_i32")
    source = accy.upload(backend, values)
    result = backend.allocate_buffer(4 * (n + 1))
    try:
        await launch_pipeline(
            backend,
            PipelineLaunch.of(
                document,
                operands=(source.bind("read_only", offset=4, byte_size=4 * n),),
                results=(result.bind(offset=4, byte_size=4 * n),),
                runtime_scalar_arguments=(p.U32(n),),
                format=fmt_of(backend),
            ),
        )
        got = await accy.download(backend, result, np.int32, n + 1)
    finally:
        backend.destroy_all([source, result])
    np.testing.assert_array_equal(got[1:], wrapped_cumsum(values[1:]))


def test_the_single_pass_scan_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="method='three_stage'"):
        library.prefix_sum(p.DType.F64, method="single_pass")
    with pytest.raises(ValueError, match="vectors"):
        library.prefix_sum(p.DType.F32, vectors=0)
    with pytest.raises(ValueError, match="method must be"):
        library.prefix_sum(p.DType.F32, method="four_stage")  # type: ignore[arg-type]
    assert len(library.prefix_sum(p.DType.F64).pipeline.stages) == 3  # 8-byte: the reference
    assert len(library.load_builtin("prefix_sum_i32").pipeline.stages) == 2


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["prefix_sum_f32", "prefix_sum_f32_three_stage"])
async def test_prefix_sum_of_floats_is_within_rounding(
    executing_backend: accy.Backend, n: int, name: str
) -> None:
    rng = np.random.default_rng(n + 1)
    values = rng.random(n, dtype=np.float32)
    document = library.load_builtin(name)
    got = await run_document(executing_backend, document, [values], (p.U32(n),), np.float32, n)
    reference = np.cumsum(values.astype(np.float64))
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-3)


async def test_saxpy_and_sum(executing_backend: accy.Backend) -> None:
    n = 100_003
    rng = np.random.default_rng(7)
    x, y = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    got = await run_document(
        executing_backend,
        library.load_builtin("saxpy_f32"),
        [x, y],
        (p.U32(n), p.F32(2.5)),
        np.float32,
        n,
    )
    np.testing.assert_allclose(got, np.float32(2.5) * x + y, rtol=1e-6)
    total = await run_document(
        executing_backend, library.load_builtin("sum_f32"), [x], (p.U32(n),), np.float32, 1
    )
    assert total[0] == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-5)
    ints = rng.integers(0, 100, n, dtype=np.int64)
    exact = await run_document(
        executing_backend, library.reduce_sum(p.DType.I64), [ints], (p.U32(n),), np.int64, 1
    )
    assert exact[0] == int(ints.sum())


async def test_a_thousand_concurrent_launches_share_one_pool(
    executing_backend: accy.Backend,
) -> None:
    """1,000 tasks launch one pool at once on 8 streams, each with its own operands and scratch."""
    backend = executing_backend
    document = library.prefix_sum(p.DType.I32, 64)
    fmt = fmt_of(backend)
    failures: list[int] = []
    streams = [backend.create_stream() for _ in range(8)]
    async with await load_pipeline_artifacts(
        backend, document.pipeline, document.registry, fmt
    ) as pool:

        async def one(task: int) -> None:
            stream = streams[task % len(streams)]
            n = 1 + (task * 37) % 3000
            values = np.arange(task, task + n, dtype=np.int32)
            scalars = (p.U32(n),)
            source = accy.upload(backend, values, stream=stream)
            result = backend.allocate_buffer(4 * n)
            async with await allocate_pipeline_intermediates(
                backend, document.pipeline, scalars
            ) as scratch:
                await launch_pipeline(
                    backend,
                    PipelineLaunch(
                        pipeline=document.pipeline,
                        registry=document.registry,
                        format=fmt,
                        operands=[source.bind("read_only")],
                        results=[result.bind()],
                        runtime_scalar_arguments=scalars,
                        intermediates=scratch,
                        artifacts=pool,
                        stream=stream,
                    ),
                )
                got = await accy.download(backend, result, np.int32, n, stream=stream)
            if not np.array_equal(got, np.cumsum(values, dtype=np.int32)):
                failures.append(task)
            backend.destroy_all([source, result])

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                for task in range(1000):
                    group.start_soon(one, task)
    assert failures == []
    backend.destroy_all(streams)
    assert not backend.live_objects(owned_only=True)


def test_shipped_plan_files_match_their_builders() -> None:
    for name in library.BUILTIN_PLANS:
        assert library.load_builtin(name) == library.builtin_document(name), name


def test_builders_refuse_what_the_kernels_cannot_do() -> None:
    with pytest.raises(ValueError, match="power of two"):
        library.prefix_sum(p.DType.F32, 100)
    with pytest.raises(ValueError, match="built-in kernels take"):
        library.prefix_sum(p.DType.F16)
    with pytest.raises(ValueError, match="f32 or f64"):
        library.saxpy(p.DType.I32)
    with pytest.raises(KeyError, match="no built-in plan"):
        library.load_builtin("nope")


async def test_n_zero_and_n_beyond_bounds_are_refused_before_allocation(
    recording: accy.RecordingBackend,
) -> None:
    document = library.load_builtin("prefix_sum_f32")
    x = recording.external_buffer(64).bind()
    for scalars, error in (
        ((p.U32(0),), accy.LimitExceeded),
        ((p.I32(5),), accy.LaunchArgumentMismatch),
    ):
        with pytest.raises(error):
            await launch_pipeline(
                recording,
                PipelineLaunch(
                    pipeline=document.pipeline,
                    registry=document.registry,
                    format=p.ArtifactFormat.CPU,
                    operands=[x],
                    results=[x],
                    runtime_scalar_arguments=scalars,
                ),
            )
    assert recording.buffer_allocate_count == 0


# ----- on the GPU, at the sizes the kernels are built for -----------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["prefix_sum_i32", "prefix_sum_f32", "sum_f32"])
async def test_a_hundred_million_elements_again_and_again_on_the_gpu(name: str) -> None:
    """The look-back scan's tiles race each other: relaunch, and check every result."""
    n = 10**8 + 7
    rng = np.random.default_rng(17)
    document = library.load_builtin(name)
    floats = document.operands[0].dtype is p.DType.F32
    values = (
        rng.random(n, dtype=np.float32)
        if floats
        else rng.integers(-(2**31), 2**31, n, dtype=np.int32)
    )
    if name == "sum_f32":
        expected: np.ndarray[Any, Any] = np.array([values.astype(np.float64).sum()])
    else:
        expected = np.cumsum(values.astype(np.float64 if floats else np.int64))
    scalars = (p.U32(n),)
    async with accy.open_backend("cuda") as backend:
        fmt = p.ArtifactFormat.CUDA_SOURCE
        pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry, fmt)
        scratch = await allocate_pipeline_intermediates(backend, document.pipeline, scalars)
        source = accy.upload(backend, values)
        count = 1 if name == "sum_f32" else n
        result = backend.allocate_buffer(4 * count)
        async with pool, scratch:
            request = PipelineLaunch.of(
                document, operands=(source.bind("read_only"),), results=(result.bind(),),
                runtime_scalar_arguments=scalars, intermediates=scratch, artifacts=pool,
            )  # fmt: skip
            for _ in range(4):
                await launch_pipeline(backend, request)
                got = await accy.download(backend, result, values.dtype, count)
                if floats:
                    np.testing.assert_allclose(got, expected, rtol=2e-5 if count == n else 1e-5)
                else:
                    np.testing.assert_array_equal(got, expected.astype(np.int32))
        backend.destroy_all([source, result])
