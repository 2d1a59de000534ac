"""Several devices in one process: ``cuda:N`` backends, copies between backends, contexts.

On any machine: copies between two CPU backends (through the host) land after
the producer's work and in order on the consumer's stream, bad ranges are
refused before anything is enqueued, and the backend kinds parse. On a GPU:
two CUDA backends copy on the device with no host wait, each backend keeps to
its own context when another is current on the thread, and ``cuda:N`` names a
device that exists. On two GPUs (``nvidia-h200-x2``): a producer on GPU 0 and
a consumer on GPU 1, ordered on the devices.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import accy_async as accy
from accy_async.testing import assert_checkpoint, live_after_drain

from .conftest import GPU_AVAILABLE, GPU_COUNT, needs_gpu, needs_two_gpus
from .kernels import grid_for, load

N = 4096
SPIN_NS = 300_000_000
"""How long the slow producer spins: a copy that waited for it on the host would take this."""


async def _produce(backend: accy.Backend, value: float, stream: accy.StreamHandle) -> Any:
    """A buffer that a slow kernel on ``stream`` fills with ``value``."""
    slow = await load(backend, "slow_fill_f32")
    buffer = backend.allocate_buffer(4 * N)
    grid, block = grid_for(N)
    backend.launch(
        slow,
        [buffer.bind("write_only")],
        [accy.U32(N), accy.F32(value), accy.U64(SPIN_NS)],
        accy.LaunchConfig(grid, block),
        stream=stream,
    )
    return buffer, slow


async def _copy_after_a_slow_producer(source: accy.Backend, target: accy.Backend) -> float:
    """Copy what a slow kernel on ``source`` writes into ``target``; the seconds the copy call
    took. The copy must land after the kernel, and on ``target``'s stream before its read."""
    producer = source.create_stream()
    consumer = target.create_stream()
    buffer, slow = await _produce(source, 7.0, producer)
    landed = target.allocate_buffer(4 * N)
    started = time.perf_counter()
    await accy.copy_between(source, buffer, target, landed, after=producer, stream=consumer)
    took = time.perf_counter() - started
    values = await accy.download(target, landed, np.float32, stream=consumer)
    np.testing.assert_array_equal(values, 7.0)
    await accy.wait_stream(source, producer)
    source.destroy_all([buffer, slow, producer])
    target.destroy_all([landed, consumer])
    return took


async def test_a_copy_between_cpu_backends_follows_the_producer() -> None:
    async with accy.open_backend("cpu") as one, accy.open_backend("cpu") as two:
        await _copy_after_a_slow_producer(one, two)  # staged through the host
        await _copy_after_a_slow_producer(one, one)  # one backend, two streams
        assert await live_after_drain(one) == {} and await live_after_drain(two) == {}


async def test_bad_ranges_are_refused_before_anything_is_enqueued() -> None:
    async with accy.open_backend("cpu") as one, accy.open_backend("cpu") as two:
        small, large = one.allocate_buffer(64), two.allocate_buffer(128)
        with pytest.raises(accy.InvalidBuffer) as raised:
            await accy.copy_between(one, small, two, large, 128)
        assert raised.value.path == "$.source[0]"
        with pytest.raises(accy.InvalidBuffer) as raised:
            await accy.copy_between(two, large, one, small)
        assert raised.value.path == "$.destination[0]"
        with pytest.raises(accy.InvalidBuffer) as raised:
            await accy.copy_between(two, small, one, small, 8)  # small is one's, not two's
        assert raised.value.path == "$.source[0]"
        await assert_checkpoint(lambda: accy.copy_between(one, small, two, large, 0))
        await assert_checkpoint(lambda: accy.copy_between(one, small, two, large, 64))
        await accy.wait_stream(two)
        one.destroy(small)
        two.destroy(large)


def test_backend_kinds_name_a_device() -> None:
    for kind in ("cuda:x", "cuda:", "cuda:-1", "cuda:²", "cuda:٣"):
        with pytest.raises(ValueError, match="cuda:N"):
            accy.create_backend(kind)
    with pytest.raises(ValueError, match="do not pass device="):
        accy.create_backend("cuda:0", device=1)
    with pytest.raises(ValueError, match="unknown backend kind"):
        accy.create_backend("gpu")
    if GPU_COUNT < 2:  # no such device (or no driver): a clear error
        match = "there is no CUDA device 1" if GPU_AVAILABLE else "driver"
        with pytest.raises(accy.RuntimeUnavailable, match=match):
            accy.create_backend("cuda:1")


@pytest.mark.gpu
@needs_gpu
async def test_cuda_backends_copy_on_the_device_without_waiting() -> None:
    async with accy.open_backend("cuda:0") as one, accy.open_backend("cuda") as two:
        assert one.dlpack_device == two.dlpack_device == (2, 0)
        took = await _copy_after_a_slow_producer(one, two)
        assert took < SPIN_NS / 1e9 / 2  # enqueued: the host did not wait for the producer
        assert await live_after_drain(one) == {} and await live_after_drain(two) == {}


@pytest.mark.gpu
@needs_gpu
async def test_a_backend_keeps_to_its_context_when_another_is_current() -> None:
    """Another library (or a backend of another device) made its context current on this
    thread: what the backend makes is still its own, and its work runs."""
    from cuda.bindings import driver as d

    async with accy.open_backend("cuda") as backend:
        device = d.cuDeviceGet(0)[1]
        try:
            result, other = d.cuCtxCreate(d.CUctxCreateParams(), 0, device)
        except (AttributeError, TypeError):  # cuda-bindings before 13 take (flags, device)
            result, other = d.cuCtxCreate(0, device)
        assert int(result) == 0
        try:
            assert int(d.cuCtxSetCurrent(other)[0]) == 0
            buffer = backend.allocate_buffer(4 * N)
            stream = backend.create_stream()
            assert int(d.cuCtxGetCurrent()[1]) == int(other)  # the other context current again
            owner = d.cuPointerGetAttribute(
                d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT, buffer.address
            )[1]
            assert int(owner) == int(backend._context)  # type: ignore[attr-defined]
            assert int(d.cuStreamGetCtx(stream.native)[1]) == int(backend._context)  # type: ignore[attr-defined]
            d.cuCtxSetCurrent(other)
            kernel = await load(backend, "slow_fill_f32")
            d.cuCtxSetCurrent(other)
            grid, block = grid_for(N)
            backend.launch(
                kernel,
                [buffer.bind("write_only")],
                [accy.U32(N), accy.F32(2.5), accy.U64(0)],
                accy.LaunchConfig(grid, block),
                stream=stream,
            )
            d.cuCtxSetCurrent(other)
            values = await accy.download(backend, buffer, np.float32, stream=stream)
            np.testing.assert_array_equal(values, 2.5)
            backend.destroy_all([kernel, buffer, stream])
        finally:
            d.cuCtxDestroy(other)
        assert await live_after_drain(backend) == {}


@pytest.mark.gpu
@needs_two_gpus
async def test_a_producer_on_one_gpu_feeds_a_consumer_on_another() -> None:
    """GPU 0 fills, the copy crosses to GPU 1 on the device, GPU 1 adds one: no host wait."""
    async with accy.open_backend("cuda:0") as zero, accy.open_backend("cuda:1") as one:
        assert zero.dlpack_device == (2, 0) and one.dlpack_device == (2, 1)
        took = await _copy_after_a_slow_producer(zero, one)
        assert took < SPIN_NS / 1e9 / 2
        add_one = await load(one, "add_one_f32")
        producer, consumer = zero.create_stream(), one.create_stream()
        for round_index in range(10):
            source, slow = await _produce(zero, float(round_index), producer)
            landed, out = one.allocate_buffer(4 * N), one.allocate_buffer(4 * N)
            await accy.copy_between(zero, source, one, landed, after=producer, stream=consumer)
            grid, block = grid_for(N)
            one.launch(
                add_one,
                [out.bind("write_only"), landed.bind("read_only")],
                [accy.U32(N)],
                accy.LaunchConfig(grid, block),
                stream=consumer,
            )
            values = await accy.download(one, out, np.float32, stream=consumer)
            np.testing.assert_array_equal(values, round_index + 1.0)
            await accy.wait_stream(zero, producer)
            zero.destroy_all([source, slow])
            one.destroy_all([landed, out])
        zero.destroy(producer)
        one.destroy_all([consumer, add_one])
        assert await live_after_drain(zero) == {} and await live_after_drain(one) == {}


@pytest.mark.gpu
@needs_two_gpus
async def test_a_launch_graph_spread_over_two_gpus() -> None:
    """The diamond with its middle on GPU 1: slots cross both ways, results as on one GPU."""
    from .test_graph_call import spread_document

    x = np.arange(1000, dtype=np.float32)
    async with accy.open_backend("cuda:0") as zero, accy.open_backend("cuda:1") as one:
        for devices in ((0, 1, 1), (0, 1, 0), (1, 0, 1)):
            document = spread_document(zero, devices)
            async with accy.open_graph(document, backend=[zero, one]) as run:
                for _ in range(5):
                    out = await run({1: x}, read=[4])
                    np.testing.assert_array_equal(out[4], x + (x + 1))
        assert await live_after_drain(zero) == {} and await live_after_drain(one) == {}
