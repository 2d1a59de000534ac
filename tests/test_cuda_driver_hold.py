"""What the CUDA driver holds while a kernel runs, and what the backend does about it. ``-m gpu``.

A module load or unload, or a ``cuMemFree``, waits for every kernel running on
the device, and the driver holds every other thread's launches, records and
allocations meanwhile. The backend keeps destroyed buffers' memory and
destroyed kernels' modules for reuse, and runs what remains on worker threads
after the device's running work, so the loop's own driver calls are not held.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import AsyncIterator

import anyio
import msgspec
import numpy as np
import pytest

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.backends.cuda import CudaBackend
from accy_async.pipeline import PipelineLaunch, launch_pipeline
from accy_async.testing import assert_checkpoint

from .conftest import needs_gpu
from .kernels import grid_for, load, spec

pytestmark = [pytest.mark.gpu, needs_gpu]

SPIN_NS = 200_000_000
"""How long the running kernel spins: a driver call held behind it takes about this long."""

CACHING = not os.environ.get("ACCY_CUDA_NO_CACHING")
"""Whether the backend keeps memory and modules (not under compute-sanitizer's memcheck)."""
keeps = pytest.mark.skipif(not CACHING, reason="ACCY_CUDA_NO_CACHING: nothing is kept")

HELD_S = 0.05
"""A loop driver call slower than this was held behind the running kernel (a quarter of it)."""


@pytest.fixture
async def cuda() -> AsyncIterator[CudaBackend]:
    backend = CudaBackend()
    try:
        yield backend
    finally:
        await backend.aclose()


def _spin(backend: accy.Backend, slow: accy.LoadedArtifact, stream: accy.StreamHandle) -> None:
    """Keep the device busy for :data:`SPIN_NS` on ``stream``."""
    buffer = backend.allocate_buffer(4 * 32)
    backend.launch(
        slow,
        [buffer.bind("write_only")],
        [accy.U32(32), accy.F32(1.0), accy.U64(SPIN_NS)],
        accy.LaunchConfig(*grid_for(32)),
        stream=stream,
    )
    backend.defer_destroy([buffer], after=stream)


class Probe:
    """Driver calls of the loop, timed: launches, event records and allocations on a stream.

    Made before the device is busy, so that nothing it needs waits before the timing.
    """

    def __init__(self, backend: accy.Backend, tiny: accy.LoadedArtifact) -> None:
        self.backend = backend
        self.tiny = tiny
        self.stream = backend.create_stream()
        self.out = backend.allocate_buffer(4 * 32)
        self.event = backend.create_event()
        self.slowest = 0.0
        """The slowest call so far, in seconds."""

    def calls(self, count: int) -> None:
        """Time ``count`` launches, event records and allocations (the buffers freed later)."""
        backend = self.backend
        made: list[accy.BufferHandle] = []
        for _ in range(count):
            started = time.perf_counter()
            backend.launch(
                self.tiny,
                [self.out.bind("write_only")],
                [accy.U32(32), accy.F32(2.0)],
                accy.LaunchConfig(*grid_for(32)),
                stream=self.stream,
            )
            backend.record_event(self.event, self.stream)
            made.append(backend.allocate_buffer(4096 + len(made)))  # new memory each time
            self.slowest = max(self.slowest, time.perf_counter() - started)
        backend.defer_destroy(made, after=self.stream)

    def check(self) -> None:
        assert self.slowest < HELD_S, f"a driver call of the loop took {self.slowest * 1e3:.1f} ms"

    async def close(self) -> None:
        await accy.wait_stream(self.backend, self.stream)
        self.backend.destroy_all([self.out, self.event, self.stream])


@keeps
async def test_a_destroyed_buffers_memory_serves_the_next_allocation(cuda: CudaBackend) -> None:
    blocks = cuda._device_state.blocks
    first = cuda.allocate_buffer(1 << 20)
    address = first.address
    cuda.destroy(first)
    assert blocks.held >= 1 << 20
    again = cuda.allocate_buffer((1 << 20) - 4096)  # fits the kept block with little to spare
    assert (again.address, blocks.taken, blocks.held) == (address, 1, 0)
    values = np.arange(again.byte_size // 4, dtype=np.int32)
    cuda.write_buffer(again, values.view(np.uint8).data)
    np.testing.assert_array_equal(await accy.download(cuda, again, np.int32), values)
    cuda.destroy(again)
    larger = cuda.allocate_buffer(4 << 20)  # no kept block fits it: new memory
    tiny = cuda.allocate_buffer(16)  # the kept megabyte is far too large for it
    assert blocks.taken == 1
    aligned = cuda.allocate_buffer(1 << 20, alignment=4096)
    assert aligned.address % 4096 == 0
    cuda.destroy_all([larger, tiny, aligned])


async def test_a_zero_memory_cache_keeps_nothing() -> None:
    backend = CudaBackend(memory_cache_bytes=0)
    try:
        buffer = backend.allocate_buffer(1 << 20)
        backend.destroy(buffer)
        assert backend._device_state.blocks.held == 0
        backend.destroy(backend.allocate_buffer(1 << 20))
        assert backend._device_state.blocks.taken == 0
    finally:
        await backend.aclose()
    with pytest.raises(ValueError, match="memory_cache_bytes"):
        CudaBackend(memory_cache_bytes=-1)


@keeps
async def test_a_pipeline_without_a_pool_loads_its_kernels_once(cuda: CudaBackend) -> None:
    document = library.load_builtin("prefix_sum_i32")
    n = 50_000
    x = accy.upload(cuda, np.ones(n, np.int32))
    y = cuda.allocate_buffer(4 * n)
    request = PipelineLaunch.of(
        document, operands=[x.bind("read_only")], results=[y.bind()], runtime_scalar_arguments=[n]
    )
    shelf = cuda._device_state.shelf
    stages = len(document.pipeline.stages)
    for round_ in range(3):
        await launch_pipeline(cuda, request)
        assert shelf.taken == stages * round_  # the first call loaded them, the rest reuse them
        got = await accy.download(cuda, y, np.int32)
        np.testing.assert_array_equal(got, np.arange(1, n + 1, dtype=np.int32))
    assert set(cuda.live_objects(owned_only=True)) == {x.id, y.id}
    cuda.destroy_all([x, y])


async def test_a_load_behind_a_running_kernel_holds_no_call_of_the_loop(
    cuda: CudaBackend,
) -> None:
    slow, tiny = await load(cuda, "slow_fill_f32"), await load(cuda, "iota_f32")
    # A kernel no load of this process has seen: its module must be loaded for real.
    source = spec(cuda, "iota_f32")
    assert isinstance(source.payload, p.TextPayload)
    unique = f"base + (float)i + {random.randrange(1, 1 << 20)}.0f"
    payload = p.TextPayload(source.payload.text.replace("base + (float)i", unique))
    artifact = await cuda.create_artifact(msgspec.structs.replace(source, payload=payload))
    busy = cuda.create_stream()
    probe = Probe(cuda, tiny)
    _spin(cuda, slow, busy)
    started = time.perf_counter()
    loaded: list[accy.LoadedArtifact] = []
    async with anyio.create_task_group() as group:

        async def load_it() -> None:
            loaded.append(await cuda.load_artifact(artifact))

        group.start_soon(load_it)
        while not loaded:
            await anyio.sleep(0.002)
            probe.calls(2)
    assert time.perf_counter() - started > SPIN_NS / 1e9 / 2  # the load waited for the kernel
    probe.check()
    await accy.wait_stream(cuda, busy)
    await probe.close()
    cuda.destroy_all([*loaded, slow, tiny, busy])


async def test_a_free_behind_a_running_kernel_holds_no_call_of_the_loop() -> None:
    backend = CudaBackend(memory_cache_bytes=0)  # every destroyed buffer is freed
    try:
        slow, tiny = await load(backend, "slow_fill_f32"), await load(backend, "iota_f32")
        busy = backend.create_stream()
        probe = Probe(backend, tiny)
        freed = backend.allocate_buffer(1 << 20)
        _spin(backend, slow, busy)
        backend.destroy(freed)  # the janitor's cuMemFree would wait for the spinning kernel
        for _ in range(5):
            await anyio.sleep(0.005)
            probe.calls(2)
        probe.check()
        await accy.wait_stream(backend, busy)
        await probe.close()
        backend.destroy_all([slow, tiny, busy])
    finally:
        await backend.aclose()


async def test_a_cancelled_pipeline_behind_a_running_kernel_holds_no_call_of_the_loop(
    cuda: CudaBackend,
) -> None:
    # Cancelled while its kernels wait to load behind another stream's kernel: it returns
    # at once, and its scratch goes to deferred release.
    document = library.load_builtin("prefix_sum_i32")
    slow, tiny = await load(cuda, "slow_fill_f32"), await load(cuda, "iota_f32")
    busy = cuda.create_stream()
    probe = Probe(cuda, tiny)
    x, y = cuda.allocate_buffer(4096), cuda.allocate_buffer(4096)
    request = PipelineLaunch.of(
        document,
        operands=[x.bind("read_only")],
        results=[y.bind()],
        runtime_scalar_arguments=[1024],
        stream=probe.stream,
    )
    for _ in range(2):
        _spin(cuda, slow, busy)
        with anyio.move_on_after(0.01) as scope:
            await launch_pipeline(cuda, request)
        assert scope.cancelled_caught
        for _ in range(3):
            await anyio.sleep(0.005)
            probe.calls(2)
        await accy.wait_stream(cuda, busy)
    probe.check()
    await probe.close()
    cuda.destroy_all([x, y, slow, tiny, busy])


async def test_empty_cache_gives_the_kept_memory_back(cuda: CudaBackend) -> None:
    state = cuda._device_state
    buffers = [cuda.allocate_buffer(1 << 20) for _ in range(3)]
    cuda.destroy_all(buffers)
    kept = state.blocks.held
    assert kept == (3 << 20 if CACHING else 0)
    assert await cuda.empty_cache() == kept
    assert state.blocks.held == 0 and len(state.shelf) == 0
    assert await cuda.empty_cache() == 0
    await assert_checkpoint(cuda.empty_cache)  # a checkpoint with nothing to free, too


async def test_memory_other_libraries_were_offered_is_freed_not_kept(cuda: CudaBackend) -> None:
    buffer = cuda.allocate_buffer(1 << 20)
    accy.ArrayView(cuda, buffer, np.float32)
    cuda.destroy(buffer)
    assert cuda._device_state.blocks.held == 0
