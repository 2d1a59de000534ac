"""The backend contract, one set of tests run on every backend present, on asyncio and trio.

Recording and CPU run everywhere; CUDA runs where there is a GPU (``-m gpu``).
Tests that read results back run only on backends that execute kernels.
"""

from __future__ import annotations

import struct

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async.backends import Backend
from accy_async.waiting import CompletionLatch

from .conftest import EXECUTING_BACKEND_PARAMS
from .kernels import grid_for, load, spec

N = 1000


def executes(backend: Backend) -> bool:
    return backend.kind != "recording"


def _address(buffer: accy.BufferHandle) -> int | None:
    native = buffer.native
    if isinstance(native, np.ndarray):
        return int(native.ctypes.data)
    if isinstance(native, int):
        return native
    return None


async def test_buffers_are_aligned_tracked_and_destroyed_exactly_once(backend: Backend) -> None:
    buffers = [backend.allocate_buffer(size) for size in (1, 255, 256, 4097)]
    assert {backend.live_objects()[b.id] for b in buffers} == {"buffer"}
    for buffer in buffers:
        address = _address(buffer)
        if address is not None:
            assert address % accy.backends.DEFAULT_ALIGNMENT == 0
    for buffer in buffers:
        backend.destroy(buffer)
    assert not any(b.id in backend.live_objects() for b in buffers)
    with pytest.raises(accy.InvalidBuffer, match="destroyed twice"):
        backend.destroy(buffers[0])


async def test_bad_buffer_requests_are_refused_before_the_device_is_asked(
    backend: Backend,
) -> None:
    before = dict(backend.live_objects())
    with pytest.raises(accy.InvalidBuffer):
        backend.allocate_buffer(0)
    with pytest.raises(accy.InvalidBuffer):
        backend.allocate_buffer(16, alignment=3)
    with pytest.raises(accy.LimitExceeded):
        backend.allocate_buffer(2**60)
    assert dict(backend.live_objects()) == before
    if isinstance(backend, accy.RecordingBackend):
        assert backend.buffer_allocate_count == 0


async def test_handles_of_another_backend_are_refused(backend: Backend) -> None:
    async with accy.open_backend("recording") as other:
        foreign = other.allocate_buffer(64)
        with pytest.raises(accy.InvalidBuffer):
            backend.destroy(foreign)
        with pytest.raises(accy.InvalidBuffer):
            backend.fill_buffer(foreign, 0)
        other.destroy(foreign)


async def test_write_then_read_round_trips(backend: Backend) -> None:
    buffer = backend.allocate_buffer(4 * N)
    data = np.arange(N, dtype=np.float32)
    backend.write_buffer(buffer, data.tobytes())
    data[:] = -1  # the bytes were taken at the call
    got = np.frombuffer(await accy.wait_read(backend.enqueue_read(buffer)), np.float32)
    if executes(backend):
        np.testing.assert_array_equal(got, np.arange(N, dtype=np.float32))
    else:
        assert got.size == N
    partial = await accy.wait_read(backend.enqueue_read(buffer, offset=8, byte_size=8))
    assert len(partial) == 8
    with pytest.raises(accy.InvalidBuffer):
        backend.enqueue_read(buffer, offset=4 * N - 4, byte_size=8)
    with pytest.raises(accy.InvalidBuffer):
        backend.write_buffer(buffer, bytes(8), offset=4 * N)
    backend.destroy(buffer)


async def test_fill_writes_the_32_bit_pattern(backend: Backend) -> None:
    buffer = backend.allocate_buffer(4 * N)
    backend.fill_buffer(buffer, 0xDEADBEEF)
    got = np.frombuffer(await accy.wait_read(backend.enqueue_read(buffer)), np.uint32)
    if executes(backend):
        assert (got == 0xDEADBEEF).all()
    with pytest.raises(accy.LaunchArgumentMismatch):
        backend.fill_buffer(buffer, 2**32)
    backend.destroy(buffer)


async def test_device_copies_land_in_stream_order(backend: Backend) -> None:
    source = backend.allocate_buffer(4 * N)
    target = backend.allocate_buffer(8 * N)
    backend.write_buffer(source, np.arange(N, dtype=np.uint32).tobytes())
    backend.fill_buffer(target, 7)
    backend.copy_buffer(source, target, destination_offset=4 * N)
    backend.copy_buffer(target, target, 400, source_offset=4 * N)  # within one buffer
    got = np.frombuffer(await accy.wait_read(backend.enqueue_read(target)), np.uint32)
    if executes(backend):
        np.testing.assert_array_equal(got[N:], np.arange(N, dtype=np.uint32))
        np.testing.assert_array_equal(got[:100], np.arange(100, dtype=np.uint32))
        assert (got[100:N] == 7).all()
    with pytest.raises(accy.InvalidBuffer, match="overlap"):
        backend.copy_buffer(target, target, 400, destination_offset=200)
    with pytest.raises(accy.InvalidBuffer):
        backend.copy_buffer(target, source)  # larger than the destination
    backend.destroy_all([source, target])


async def test_a_never_recorded_event_is_complete(backend: Backend) -> None:
    event = backend.create_event()
    assert backend.query_event(event)
    await accy.wait_event(backend, event)
    backend.destroy(event)


async def test_streams_events_and_device_side_waits(backend: Backend) -> None:
    kernel = await load(backend, "iota_f32")
    copy = await load(backend, "copy_f32")
    a_stream, b_stream = backend.create_stream(), backend.create_stream()
    produced = backend.create_event()
    source, target = backend.allocate_buffer(4 * N), backend.allocate_buffer(4 * N)
    grid, block = grid_for(N)
    backend.launch(
        kernel,
        [source.bind("write_only")],
        [accy.U32(N), accy.F32(7.0)],
        accy.LaunchConfig(grid, block),
        stream=a_stream,
        signal_event=produced,
    )
    backend.launch(
        copy,
        [target.bind("write_only"), source.bind("read_only")],
        [accy.U32(N)],
        accy.LaunchConfig(grid, block),
        stream=b_stream,
        wait_events=[produced],
    )
    await accy.wait_stream(backend, b_stream)
    got = np.frombuffer(
        await accy.wait_read(backend.enqueue_read(target, stream=b_stream)), np.float32
    )
    if executes(backend):
        np.testing.assert_array_equal(got, 7.0 + np.arange(N, dtype=np.float32))
    assert backend.query_stream(b_stream)
    await accy.synchronize(backend)
    for obj in (kernel, copy, a_stream, b_stream, produced, source, target):
        backend.destroy(obj)


async def test_launch_arguments_are_checked_before_anything_is_enqueued(
    backend: Backend,
) -> None:
    kernel = await load(backend, "copy_f32")
    out, src = backend.allocate_buffer(4 * N), backend.allocate_buffer(4 * N)
    grid, block = grid_for(N)
    launched_before = getattr(backend, "launch_count", 0)
    with pytest.raises(accy.LaunchArgumentMismatch, match="takes 2 buffers and 1 scalars"):
        backend.launch(kernel, [out.bind()], [accy.U32(N)], accy.LaunchConfig(grid, block))
    with pytest.raises(accy.LaunchArgumentMismatch):
        backend.launch(kernel, [out.bind(), src.bind()], [], accy.LaunchConfig(grid, block))
    backend.destroy(src)
    with pytest.raises(accy.InvalidBuffer, match="not a live buffer"):
        backend.launch(
            kernel, [out.bind(), src.bind()], [accy.U32(N)], accy.LaunchConfig(grid, block)
        )
    with pytest.raises(accy.InvalidBuffer, match="outside its buffer"):
        backend.launch(
            kernel,
            [out.bind(offset=8, byte_size=4 * N), out.bind()],
            [accy.U32(N)],
            accy.LaunchConfig(grid, block),
        )
    assert getattr(backend, "launch_count", 0) == launched_before
    backend.destroy(kernel)
    with pytest.raises(accy.InvalidArtifact):
        backend.launch(
            kernel, [out.bind(), out.bind()], [accy.U32(N)], accy.LaunchConfig(grid, block)
        )
    backend.destroy(out)


async def test_unknown_formats_are_refused(backend: Backend) -> None:
    missing = [f for f in accy.ArtifactFormat if f not in backend.formats]
    if not missing:
        pytest.skip("this backend takes every format")
    fmt = missing[0]
    payload = {
        accy.ArtifactFormat.CPU: accy.plan.CpuKernelPayload("tests.copy_f32"),
        accy.ArtifactFormat.CUDA_CUBIN: accy.plan.BinaryPayload(b"\0"),
    }.get(fmt, accy.plan.TextPayload("x"))
    with pytest.raises(accy.InvalidArtifact, match="cannot create"):
        await backend.create_artifact(spec(backend, "copy_f32", format=fmt, payload=payload))


async def test_the_default_stream_cannot_be_destroyed(backend: Backend) -> None:
    with pytest.raises(accy.InvalidBuffer):
        backend.destroy(backend.default_stream)


async def test_completion_callbacks_fire_once_and_can_be_withdrawn(backend: Backend) -> None:
    stream = backend.create_stream()
    fired: list[BaseException | None] = []
    done = CompletionLatch()

    def callback(error: BaseException | None) -> None:
        fired.append(error)
        done(error)

    registration = backend.notify_when_stream_complete(stream, callback)
    await done.wait()
    await accy.wait_stream(backend, stream)
    assert fired == [None]
    assert registration.cancel() is False
    backend.destroy(stream)


async def test_deferred_destroy_releases_after_the_work_completes(backend: Backend) -> None:
    buffer = backend.allocate_buffer(64)
    backend.defer_destroy([buffer], after=None)
    await accy.wait_stream(backend)
    for _ in range(100):
        backend.collect_deferred()
        if buffer.id not in backend.live_objects():
            break
        await anyio.sleep(0.001)
    assert buffer.id not in backend.live_objects()
    assert backend.deferred_count == 0


async def test_a_closed_backend_refuses_work_and_warns_about_leaks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kinds: tuple[accy.backends.BackendKind, ...] = ("recording", "cpu")
    for kind in kinds:
        backend = accy.create_backend(kind)
        leaked = backend.allocate_buffer(64)
        caplog.clear()
        with pytest.warns(ResourceWarning, match="still alive"):
            await backend.aclose()
        # Logged too (Python hides ResourceWarning by default), naming the object.
        (record,) = [r for r in caplog.records if "still alive" in r.getMessage()]
        assert record.name == "accy_async" and record.levelname == "WARNING"
        assert repr(leaked) in record.getMessage()
        assert leaked.id not in backend.live_objects()
        with pytest.raises(accy.BackendClosed):
            backend.allocate_buffer(64)
        with pytest.raises(accy.BackendClosed):
            backend.create_stream()
        await backend.aclose()  # idempotent


@pytest.mark.parametrize("kind", [p.values[0] for p in EXECUTING_BACKEND_PARAMS[:1]])
async def test_scalars_reach_the_kernel_with_their_types(kind: str) -> None:
    async with accy.open_backend(kind) as backend:
        kernel = await load(backend, "iota_f32")
        out = backend.allocate_buffer(16)
        backend.launch(
            kernel,
            [out.bind()],
            [accy.U32(4), accy.F32(0.5)],
            accy.LaunchConfig((1, 1, 1), (4, 1, 1)),
        )
        got = await accy.wait_read(backend.enqueue_read(out))
        assert struct.unpack("4f", got) == (0.5, 1.5, 2.5, 3.5)
        backend.destroy(kernel)
        backend.destroy(out)
