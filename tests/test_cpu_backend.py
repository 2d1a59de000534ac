"""The CPU backend really executes: streams are threads, events and waits are real."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async.testing import assert_checkpoint

from .kernels import grid_for, load

N = 4096


async def test_a_consumer_stream_waits_for_a_slow_producer_every_time(
    cpu_backend: accy.CpuBackend,
) -> None:
    """Stream B reads what a slow kernel on stream A wrote, because it waits on A's event."""
    backend = cpu_backend
    slow = await load(backend, "slow_fill_f32")
    copy = await load(backend, "copy_f32")
    stream_a, stream_b = backend.create_stream(), backend.create_stream()
    produced = backend.create_event()
    source, target = backend.allocate_buffer(4 * N), backend.allocate_buffer(4 * N)
    grid, block = grid_for(N)
    for round_index in range(20):
        value = float(round_index + 1)
        backend.launch(
            slow,
            [source.bind("write_only")],
            [accy.U32(N), accy.F32(value), accy.U64(2_000_000)],
            accy.LaunchConfig(grid, block),
            stream=stream_a,
            signal_event=produced,
        )
        backend.launch(
            copy,
            [target.bind("write_only"), source.bind("read_only")],
            [accy.U32(N)],
            accy.LaunchConfig(grid, block),
            stream=stream_b,
            wait_events=[produced],
        )
        got = np.frombuffer(
            await accy.wait_read(backend.enqueue_read(target, stream=stream_b)), np.float32
        )
        assert (got == value).all(), f"round {round_index}: stream B did not wait for A"
    for obj in (slow, copy, stream_a, stream_b, produced, source, target):
        backend.destroy(obj)


async def test_without_the_wait_the_consumer_races_ahead(cpu_backend: accy.CpuBackend) -> None:
    """The control for the test above: the wait is what orders the streams."""
    backend = cpu_backend
    slow = await load(backend, "slow_fill_f32")
    copy = await load(backend, "copy_f32")
    stream_a, stream_b = backend.create_stream(), backend.create_stream()
    source, target = backend.allocate_buffer(4 * N), backend.allocate_buffer(4 * N)
    backend.fill_buffer(source, 0, stream=stream_a)
    await accy.wait_stream(backend, stream_a)
    grid, block = grid_for(N)
    backend.launch(
        slow,
        [source.bind("write_only")],
        [accy.U32(N), accy.F32(5.0), accy.U64(200_000_000)],
        accy.LaunchConfig(grid, block),
        stream=stream_a,
    )
    backend.launch(
        copy,
        [target.bind("write_only"), source.bind("read_only")],
        [accy.U32(N)],
        accy.LaunchConfig(grid, block),
        stream=stream_b,
    )
    got = np.frombuffer(
        await accy.wait_read(backend.enqueue_read(target, stream=stream_b)), np.float32
    )
    assert (got == 0).all()
    await accy.synchronize(backend)
    for obj in (slow, copy, stream_a, stream_b, source, target):
        backend.destroy(obj)


async def test_read_only_bindings_cannot_be_written(cpu_backend: accy.CpuBackend) -> None:
    backend = cpu_backend
    kernel = await load(backend, "iota_f32")
    out = backend.allocate_buffer(64)
    backend.launch(
        kernel,
        [out.bind("read_only")],
        [accy.U32(16), accy.F32(0.0)],
        accy.LaunchConfig((1, 1, 1), (16, 1, 1)),
    )
    with pytest.raises(accy.DeviceFault, match="read-only"):
        await accy.wait_stream(backend)
    assert backend.fault is not None
    backend.destroy(kernel)
    backend.destroy(out)


async def test_a_kernel_error_poisons_the_backend_and_fails_every_waiter(
    cpu_backend: accy.CpuBackend,
) -> None:
    backend = cpu_backend
    bad = await load(backend, "out_of_bounds")
    slow = await load(backend, "slow_fill_f32")
    other = backend.create_stream()
    buffer = backend.allocate_buffer(64)
    never = backend.create_event()
    backend.launch(
        slow,
        [buffer.bind()],
        [accy.U32(1), accy.F32(1.0), accy.U64(50_000_000)],
        accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
        stream=other,
    )
    backend.record_event(never, other)
    backend.launch(bad, [buffer.bind()], [], accy.LaunchConfig((1, 1, 1), (1, 1, 1)))
    errors: list[BaseException] = []

    async def waiter(wait: object) -> None:
        try:
            await wait  # type: ignore[misc]
        except accy.DeviceFault as exc:
            errors.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(waiter, accy.wait_stream(backend))
            group.start_soon(waiter, accy.wait_event(backend, never))
            group.start_soon(waiter, accy.wait_stream(backend, other))
    assert len(errors) >= 2
    assert all("IndexError" in str(error) for error in errors)
    assert isinstance(errors[0].__cause__, accy.DeviceFault)
    with pytest.raises(accy.DeviceFault, match=r"poisoned by an earlier device fault.*IndexError"):
        backend.allocate_buffer(16)
    with pytest.raises(accy.DeviceFault, match="poisoned"):
        backend.launch(bad, [buffer.bind()], [], accy.LaunchConfig((1, 1, 1), (1, 1, 1)))
    for obj in (bad, slow, other, buffer, never):
        backend.destroy(obj)


async def test_unregistered_cpu_kernels_are_refused(cpu_backend: accy.CpuBackend) -> None:
    spec = accy.ArtifactSpec(
        kernel_name="system",
        format=accy.ArtifactFormat.CPU,
        payload=accy.plan.CpuKernelPayload("os.system"),
        argument_count=1,
    )
    with pytest.raises(accy.InvalidArtifact, match=r"no CPU kernel is registered as 'os\.system'"):
        await cpu_backend.create_artifact(spec)


async def test_launch_does_not_block_the_calling_thread(cpu_backend: accy.CpuBackend) -> None:
    backend = cpu_backend
    slow = await load(backend, "slow_fill_f32")
    buffer = backend.allocate_buffer(64)
    backend.launch(
        slow,
        [buffer.bind()],
        [accy.U32(1), accy.F32(1.0), accy.U64(300_000_000)],
        accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
    )
    assert not backend.query_stream()  # enqueued, still running: the call returned at once
    await accy.wait_stream(backend)
    assert backend.query_stream()
    backend.destroy(slow)
    backend.destroy(buffer)


def test_cpu_kernel_names_are_checked_and_not_silently_replaced() -> None:
    with pytest.raises(ValueError, match="dotted identifier"):
        accy.cpu_kernel("no spaces allowed")
    with pytest.raises(ValueError, match="already registered"):
        accy.cpu_kernel("tests.copy_f32")(lambda ctx: None)


async def test_more_memory_than_the_machine_has_is_refused_before_allocating(
    cpu_backend: accy.CpuBackend,
) -> None:
    """Linux would grant it and kill the process on first touch: refused up front instead."""
    from accy_async.backends.cpu import host_memory_available

    available = host_memory_available()
    if available is None or available + 2**30 > cpu_backend.limits.max_buffer_bytes:
        pytest.skip("the machine's memory is unknown, or beyond the backend's own limit")
    live = len(cpu_backend.live_objects())
    with pytest.raises(accy.OutOfDeviceMemory, match="bytes are available"):
        cpu_backend.allocate_buffer(available + 2**30)
    assert len(cpu_backend.live_objects()) == live  # nothing was made


async def test_idle_streams_are_read_written_and_awaited_without_a_trip_to_their_thread(
    cpu_backend: accy.CpuBackend,
) -> None:
    """On an idle stream a small copy runs at once and a wait is only a checkpoint; behind
    queued work, the same calls queue after it and see its results."""
    backend = cpu_backend
    slow = await load(backend, "slow_fill_f32")
    stream = backend.create_stream()
    buffer = backend.allocate_buffer(4 * 8)
    worker = backend._worker(stream)
    source = np.arange(8, dtype=np.float32)
    backend.write_buffer(buffer, source.view(np.uint8).data, stream=stream)
    source[:] = -1  # the caller reuses its array at once
    read = backend.enqueue_read(buffer, stream=stream)
    await assert_checkpoint(lambda: accy.wait_stream(backend, stream))
    assert worker.enqueued == 0, "nothing went to the stream's thread"
    data = await accy.wait_read(read)
    assert np.frombuffer(data, np.float32).tolist() == list(range(8))

    backend.launch(
        slow,
        [buffer.bind()],
        [accy.U32(8), accy.F32(5.0), accy.U64(50_000_000)],
        accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
        stream=stream,
    )
    behind = backend.enqueue_read(buffer, stream=stream)  # queued behind the kernel
    backend.write_buffer(buffer, source.view(np.uint8).data, stream=stream)
    source[:] = 7  # after the write was queued: the write keeps what it was given
    assert np.frombuffer(await accy.wait_read(behind), np.float32).tolist() == [5.0] * 8
    await accy.wait_stream(backend, stream)
    assert worker.enqueued > 0
    after = backend.enqueue_read(buffer, stream=stream)
    assert np.frombuffer(await accy.wait_read(after), np.float32).tolist() == [-1.0] * 8
    backend.destroy_all([slow, buffer, stream])


async def test_a_wait_on_a_stream_whose_last_completion_is_still_firing_waits_for_it(
    cpu_backend: accy.CpuBackend,
) -> None:
    """The worker counts an operation finished before its completion step runs (an event's
    record, a read's data); an idle-stream shortcut must wait for that step too."""
    backend = cpu_backend
    stream = backend.create_stream()
    fired = threading.Event()

    def operation() -> Callable[[], None]:
        def then() -> None:  # the completion step, slow
            time.sleep(0.2)
            fired.set()

        return then

    backend._worker(stream).put(operation)
    await anyio.sleep(0.05)  # the worker has counted it finished and is in its completion step
    await accy.wait_stream(backend, stream)
    assert fired.is_set()
    backend.destroy(stream)
