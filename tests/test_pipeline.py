"""launch_pipeline beyond the seed: relaunching a request, cancellation, concurrency."""

from __future__ import annotations

import asyncio
import time

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

from .seed_fixtures import SEED_ARGUMENTS as ARGS
from .seed_fixtures import SEED_FORMAT as PTX
from .seed_fixtures import SEED_PIPELINE, SEED_REGISTRY, seed_launch, seed_request


async def test_a_relaunched_request_is_rechecked_for_what_can_change(
    recording: accy.RecordingBackend,
) -> None:
    operand, result = recording.allocate_buffer(20_000), recording.allocate_buffer(20_000)
    async with (
        await load_pipeline_artifacts(recording, SEED_PIPELINE, SEED_REGISTRY, PTX) as pool,
        await allocate_pipeline_intermediates(recording, SEED_PIPELINE, ARGS) as scratch,
    ):
        operands = [operand.bind("read_only")]
        request = seed_launch(
            operands=operands, results=(result.bind(),), intermediates=scratch, artifacts=pool
        )
        for _ in range(3):
            await launch_pipeline(recording, request)
        assert recording.launch_count == 9
        assert len({launch.buffer_ids for launch in recording.launches[::3]}) == 1
        # The caller swaps the operand in its list: the new one is checked and used.
        other = recording.allocate_buffer(20_000)
        operands[0] = other.bind("read_only")
        await launch_pipeline(recording, request)
        assert other.id in recording.launches[-3].buffer_ids
        # A buffer destroyed since is refused, and nothing is launched.
        recording.destroy(other)
        with pytest.raises(accy.InvalidBuffer):
            await launch_pipeline(recording, request)
        assert recording.launch_count == 12
        operands[0] = operand.bind("read_only")
        await launch_pipeline(recording, request)
        assert recording.launch_count == 15
        # Any object destroyed, the handles are checked again (unchanged, once is enough).
        recording.destroy(recording.allocate_buffer(16))
        await launch_pipeline(recording, request)
        assert recording.launch_count == 18
    with pytest.raises(accy.LaunchArgumentMismatch, match="closed"):
        await launch_pipeline(recording, request)
    recording.destroy_all([operand, result])


@pytest.mark.parametrize("destroyed", ["result", "stream"])
async def test_a_relaunched_request_whose_buffer_or_stream_was_destroyed_is_refused(
    recording: accy.RecordingBackend, destroyed: str
) -> None:
    operand, result = recording.allocate_buffer(20_000), recording.allocate_buffer(20_000)
    stream = recording.create_stream()
    async with (
        await load_pipeline_artifacts(recording, SEED_PIPELINE, SEED_REGISTRY, PTX) as pool,
        await allocate_pipeline_intermediates(recording, SEED_PIPELINE, ARGS) as scratch,
    ):
        request = seed_launch(
            operands=(operand.bind("read_only"),),
            results=(result.bind(),),
            intermediates=scratch,
            artifacts=pool,
            stream=stream,
        )
        for _ in range(3):  # remembered, then relaunched from its memo
            await launch_pipeline(recording, request)
        await accy.wait_stream(recording, stream)
        recording.destroy(result if destroyed == "result" else stream)
        where = r"\$\.results\[0\]" if destroyed == "result" else r"live stream .*\$\.stream"
        with pytest.raises(accy.InvalidBuffer, match=where):
            await launch_pipeline(recording, request)
        assert recording.launch_count == 9
    recording.destroy_all([operand, stream if destroyed == "result" else result])


async def test_cancelling_a_launch_that_owns_its_objects_releases_them() -> None:
    backend = accy.RecordingBackend(completion="manual")
    x, y = backend.allocate_buffer(20_000), backend.allocate_buffer(20_000)
    request = seed_launch(operands=[x.bind()], results=[y.bind()])
    with anyio.move_on_after(0.05) as scope:
        await launch_pipeline(backend, request)  # waits for a device that never finishes
    assert scope.cancelled_caught
    # The clean-up waited (shielded, bounded) and then handed the objects to the
    # backend's deferred releases: nothing is freed while the "device" may use it.
    assert backend.deferred_count == 5
    backend.complete_all()
    backend.collect_deferred()
    assert backend.deferred_count == 0
    assert set(backend.live_objects(owned_only=True)) == {x.id, y.id}
    backend.destroy_all([x, y])
    await backend.aclose()


@pytest.mark.parametrize("stream_destroyed", [False, True])
async def test_a_launch_cancelled_while_it_loads_a_kernel_leaves_at_once(
    stream_destroyed: bool,
) -> None:
    """Cancelled while stage 2's kernel loads (stage 1 is queued), the call makes no device
    call on its way out (on CUDA the driver would hold it behind the load, which waits for the
    running kernels): what it owns goes to deferred release, freed once its stream has run
    stage 1, even when the caller destroys the stream first."""
    backend = accy.RecordingBackend(completion="manual")
    x, y = backend.allocate_buffer(20_000), backend.allocate_buffer(20_000)
    stream = backend.create_stream()
    request = seed_launch(operands=[x.bind()], results=[y.bind()], stream=stream)
    create = backend.create_artifact
    with anyio.CancelScope() as scope:

        async def create_then_cancel(spec: p.ArtifactSpec) -> accy.KernelArtifact:
            if backend.create_count == 1:
                scope.cancel()  # the next checkpoint, in this create or the load, raises
            return await create(spec)

        backend.create_artifact = create_then_cancel  # type: ignore[method-assign]
        await launch_pipeline(backend, request)
    assert scope.cancelled_caught
    assert backend.launch_count == 1
    assert backend.pending_count() == 1  # stage 1 itself: nothing was marked on the way out
    assert backend.destroy_count == 0
    if stream_destroyed:
        backend.destroy(stream)  # the caller drops its stream before the backend's next call
    backend.collect_deferred()  # the release now waits for the stream (a mark behind stage 1)
    assert backend.destroy_count == int(stream_destroyed)  # nothing stage 1 may still use
    backend.complete_all()
    backend.collect_deferred()
    assert set(backend.live_objects(owned_only=True)) == {x.id, y.id} | (
        set() if stream_destroyed else {stream.id}
    )
    assert backend.destroy_count == 3 + int(stream_destroyed)  # scratch x2, stage 1's kernel
    backend.destroy_all([x, y] if stream_destroyed else [x, y, stream])
    await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_plain_asyncio_cancellation_does_not_wait_for_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``asyncio.wait_for`` cancels with ``Task.cancel()``, outside any AnyIO scope: the
    clean-up defers its releases instead of waiting (up to 30 s) for a device that is busy."""
    monkeypatch.setattr(accy.waiting, "CLEANUP_WAIT_SECONDS", 30.0)
    backend = accy.RecordingBackend(completion="manual")
    x, y = backend.allocate_buffer(20_000), backend.allocate_buffer(20_000)
    request = seed_launch(operands=[x.bind()], results=[y.bind()])
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(launch_pipeline(backend, request), 0.02)
    assert time.perf_counter() - start < 10  # not the clean-up's 30 s
    assert backend.deferred_count == 5  # two scratch buffers and three kernels, kept for now
    backend.complete_all()
    backend.collect_deferred()
    assert set(backend.live_objects(owned_only=True)) == {x.id, y.id}
    backend.destroy_all([x, y])
    await backend.aclose()


@pytest.fixture(autouse=True)
def short_cleanup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accy.waiting, "CLEANUP_WAIT_SECONDS", 0.05)


async def test_concurrent_launches_on_streams_get_their_own_results(
    cpu_backend: accy.CpuBackend,
) -> None:
    backend = cpu_backend
    document = library.prefix_sum(p.DType.I32, 64)
    streams = [backend.create_stream() for _ in range(3)]
    async with await load_pipeline_artifacts(
        backend, document.pipeline, document.registry, p.ArtifactFormat.CPU
    ) as pool:

        async def one(index: int) -> None:
            n = 5000 + index
            values = np.full(n, index + 1, np.int32)
            source = accy.upload(backend, values, stream=streams[index])
            result = backend.allocate_buffer(4 * n)
            scalars = (p.U32(n),)
            async with await allocate_pipeline_intermediates(
                backend, document.pipeline, scalars
            ) as scratch:
                for _ in range(5):
                    await launch_pipeline(
                        backend,
                        PipelineLaunch(
                            pipeline=document.pipeline,
                            registry=document.registry,
                            format=p.ArtifactFormat.CPU,
                            operands=[source.bind("read_only")],
                            results=[result.bind()],
                            runtime_scalar_arguments=scalars,
                            intermediates=scratch,
                            artifacts=pool,
                            stream=streams[index],
                        ),
                    )
                got = await accy.download(backend, result, np.int32, n, stream=streams[index])
            np.testing.assert_array_equal(got, np.cumsum(values))
            backend.destroy_all([source, result])

        async with anyio.create_task_group() as group:
            for index in range(3):
                group.start_soon(one, index)
    backend.destroy_all(streams)


async def test_plain_runtime_scalars_are_checked_whatever_was_launched_before() -> None:
    """``5`` launched first does not let ``5.0`` (or ``True``) through for a u32 later."""
    document = library.load_builtin("prefix_sum_f32")
    backend = accy.RecordingBackend()
    x, y = backend.allocate_buffer(4 * 5), backend.allocate_buffer(4 * 5)

    def request(n: object) -> PipelineLaunch:
        return PipelineLaunch(
            pipeline=document.pipeline,
            registry=document.registry,
            operands=[x.bind("read_only")],
            results=[y.bind()],
            runtime_scalar_arguments=(n,),  # type: ignore[arg-type]
        )

    await launch_pipeline(backend, request(5))
    for wrong in (5.0, True):
        with pytest.raises(accy.LaunchArgumentMismatch, match="runtime scalar argument 0"):
            await launch_pipeline(backend, request(wrong))
    backend.destroy_all([x, y])
    await backend.aclose()


async def test_buffers_are_checked_against_the_documents_shapes_before_anything_launches() -> None:
    """Undersized or mistyped operands and results are refused by name; the backend stays sound."""
    document = library.load_builtin("prefix_sum_f32")
    n = 10_000
    async with accy.CpuBackend() as backend:
        x = accy.upload(backend, np.ones(n, np.float32))
        short = backend.allocate_buffer(4 * n - 4)
        doubles = accy.upload(backend, np.ones(n, np.float64))
        y = backend.allocate_buffer(4 * n)

        async def launch(operand: accy.BufferHandle, result: accy.BufferHandle) -> None:
            await launch_pipeline(
                backend,
                PipelineLaunch.of(
                    document,
                    operands=[operand.bind("read_only")],
                    results=[result.bind()],
                    runtime_scalar_arguments=(n,),
                ),
            )

        for operand, result, path, message in (
            (short, y, r"\$\.operands\[0\]", r"operand 0 \('x'\) has 39996 bytes, .* 40000"),
            (x, short, r"\$\.results\[0\]", r"result 0 \('y'\) has 39996 bytes"),
            (doubles, y, r"\$\.operands\[0\]", r"holds f64, the plan takes f32"),
        ):
            with pytest.raises(accy.LaunchArgumentMismatch, match=message) as caught:
                await launch(operand, result)
            assert caught.value.path is not None
            assert caught.value.path.startswith(path.replace("\\", ""))
        await launch(x, y)  # nothing was poisoned: the right buffers run
        sums = await accy.download(backend, y, np.float32, n)
        assert sums[-1] == n
        backend.destroy_all([x, short, doubles, y])


async def test_a_bf16_shape_takes_the_uint16_array_it_is_uploaded_as() -> None:
    """NumPy has no bfloat16: bf16 data is uploaded as uint16, and recorded as u16."""
    backend = accy.RecordingBackend()
    x = accy.upload(backend, np.ones(10, np.uint16))
    y = backend.allocate_buffer(4 * 10)

    def request(dtype: p.DType) -> PipelineLaunch:
        shape = p.PipelineBuffer(name="x", dtype=dtype, extent=p.Fixed(10))
        return seed_launch(
            operands=[x.bind("read_only")],
            results=[y.bind()],
            runtime_scalar_arguments=(p.U32(10),),
            operand_shapes=[shape],
        )

    await launch_pipeline(backend, request(p.DType.BF16))
    await launch_pipeline(backend, request(p.DType.U16))
    with pytest.raises(accy.LaunchArgumentMismatch, match="holds u16, the plan takes f16"):
        await launch_pipeline(backend, request(p.DType.F16))
    backend.destroy_all([x, y])
    await backend.aclose()


async def test_a_pool_used_on_a_stream_destroyed_since_still_waits_for_the_others() -> None:
    """One stream gone must not make the pool's close skip waiting for the rest."""
    recording = accy.RecordingBackend(completion="manual")
    first, second = recording.create_stream(), recording.create_stream()
    operand, result = recording.allocate_buffer(20_000), recording.allocate_buffer(20_000)
    pool = await load_pipeline_artifacts(recording, SEED_PIPELINE, SEED_REGISTRY, PTX)
    scratch = await allocate_pipeline_intermediates(recording, SEED_PIPELINE, ARGS)
    for stream in (first, second):
        await launch_pipeline(recording, seed_request(operand, result, scratch, pool, stream))
    recording.complete_stream(first)
    recording.destroy(first)
    kernels = [entry.loaded for entry in pool.entries]
    with anyio.move_on_after(0.05):  # the second stream's work never completes here
        await pool.aclose()
    assert all(recording.owns(kernel) for kernel in kernels)  # still loaded: deferred
    recording.complete_all()
    recording.collect_deferred()
    assert not any(recording.owns(kernel) for kernel in kernels)
    await scratch.aclose()
    recording.destroy_all([operand, result, second])
    await recording.aclose()


async def test_closed_scratch_is_refused_even_when_the_pipeline_needs_none() -> None:
    document = library.load_builtin("saxpy_f32")
    backend = accy.RecordingBackend()
    fmt = sorted(document.registry.formats(), key=lambda each: each.value)[0]
    arguments = (p.U32(4), p.F32(2.0))
    pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry, fmt)
    scratch = await allocate_pipeline_intermediates(backend, document.pipeline, arguments)
    await scratch.aclose()
    x, y = backend.allocate_buffer(16), backend.allocate_buffer(16)
    request = PipelineLaunch(
        pipeline=document.pipeline,
        registry=document.registry,
        format=fmt,
        operands=[x.bind("read_only")] * document.pipeline.operand_count,
        results=[y.bind()],
        runtime_scalar_arguments=arguments,
        intermediates=scratch,
        artifacts=pool,
    )
    for _ in range(3):  # the first launch, and the relaunches of a remembered request
        with pytest.raises(accy.LaunchArgumentMismatch, match="intermediates are closed"):
            await launch_pipeline(backend, request)
    assert backend.launch_count == 0
    await pool.aclose()
    backend.destroy_all([x, y])


async def test_new_requests_like_earlier_ones_give_what_each_asks_for(
    cpu_backend: accy.CpuBackend,
) -> None:
    """Requests made anew each call, many alike: each computes on its own buffers and ranges.

    A request like one launched twice before relaunches that one's packed launches
    (``PipelineArtifactPool.likes``); any difference (a buffer, a byte range, the
    scalars, the stream) must launch as given.
    """
    backend = cpu_backend
    document = library.prefix_sum(p.DType.I32, 64)
    n = 3000
    rng = np.random.default_rng(7)
    values = [rng.integers(-50, 50, 2 * n, dtype=np.int32) for _ in range(2)]
    sources = [accy.upload(backend, each) for each in values]
    results = [backend.allocate_buffer(4 * 2 * n) for _ in range(2)]
    streams = [backend.create_stream() for _ in range(2)]
    async with (
        await load_pipeline_artifacts(
            backend, document.pipeline, document.registry, p.ArtifactFormat.CPU
        ) as pool,
        await allocate_pipeline_intermediates(backend, document.pipeline, (p.U32(n),)) as scratch,
    ):
        # (source, its first element, count, result, stream): each is asked for several times.
        asks = [
            (s, first, count, r, t)
            for s in (0, 1)
            for first in (0, n)
            for count in (n, n - 7)
            for r in (0, 1)
            for t in (0, 1)
        ]
        order = [*asks, *asks, *rng.permutation(len(asks)).tolist()]
        for step in order:
            source, first, count, result, stream = asks[step] if isinstance(step, int) else step
            operand = sources[source].bind("read_only", offset=4 * first, byte_size=4 * n)
            request = PipelineLaunch(
                pipeline=document.pipeline,
                registry=document.registry,
                operands=(operand,),
                results=(results[result].bind(offset=4 * first, byte_size=4 * n),),
                runtime_scalar_arguments=(p.U32(count),),
                intermediates=scratch,
                artifacts=pool,
                stream=streams[stream],
            )
            await launch_pipeline(backend, request)
            got = await accy.download(
                backend, results[result], np.int32, 2 * n, stream=streams[stream]
            )
            expected = np.cumsum(values[source][first : first + count], dtype=np.int32)
            np.testing.assert_array_equal(got[first : first + count], expected)
        assert any(like.memo is not None for like in pool.likes.values())
    backend.destroy_all([*sources, *results, *streams])


async def test_a_new_request_like_a_packed_one_is_still_checked(
    recording: accy.RecordingBackend,
) -> None:
    """Plain scalars, destroyed buffers and closed scratch are refused as for any request."""
    document = library.load_builtin("prefix_sum_f32")
    x, y = recording.allocate_buffer(4 * 5), recording.allocate_buffer(4 * 5)
    pool = await load_pipeline_artifacts(recording, document.pipeline, document.registry)
    scratch = await allocate_pipeline_intermediates(recording, document.pipeline, (p.U32(5),))

    def request(n: object, result: accy.BufferHandle = y) -> PipelineLaunch:
        return PipelineLaunch(
            pipeline=document.pipeline,
            registry=document.registry,
            operands=(x.bind("read_only"),),
            results=(result.bind(),),
            runtime_scalar_arguments=(n,),  # type: ignore[arg-type]
            intermediates=scratch,
            artifacts=pool,
        )

    for _ in range(3):  # remembered, packed, relaunched
        await launch_pipeline(recording, request(p.U32(5)))
    stages = len(document.pipeline.stages)
    assert recording.launch_count == 3 * stages
    assert [like.memo is not None for like in pool.likes.values()] == [True]
    for wrong in (5.0, True):
        with pytest.raises(accy.LaunchArgumentMismatch, match="runtime scalar argument 0"):
            await launch_pipeline(recording, request(wrong))
    other = recording.allocate_buffer(4 * 5)
    for _ in range(3):
        await launch_pipeline(recording, request(p.U32(5), other))
    assert recording.launches[-1].buffer_ids != recording.launches[0].buffer_ids
    recording.destroy(other)
    with pytest.raises(accy.InvalidBuffer, match=r"\$\.results\[0\]"):  # named in this request
        await launch_pipeline(recording, request(p.U32(5), other))
    await scratch.aclose()
    with pytest.raises(accy.LaunchArgumentMismatch, match="intermediates are closed"):
        await launch_pipeline(recording, request(p.U32(5)))
    assert recording.launch_count == 6 * stages
    await pool.aclose()
    recording.destroy_all([x, y])
