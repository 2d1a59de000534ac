"""ArrayView: our buffers offered through DLPack, checked with NumPy as the consumer."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import accy_async as accy
from accy_async import dlpack


class LegacyConsumer:
    """Asks the way consumers from before DLPack 1.0 ask: no ``max_version``."""

    def __init__(self, view: accy.ArrayView) -> None:
        self.view = view

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.view.__dlpack__(stream=stream)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.view.__dlpack_device__()


@pytest.mark.parametrize("consumer", [lambda v: v, LegacyConsumer], ids=["versioned", "legacy"])
async def test_numpy_takes_a_cpu_buffer_in_place(consumer: Any) -> None:
    async with accy.open_backend("cpu") as cpu:
        buffer = accy.upload(cpu, np.arange(10, dtype=np.int32))
        await accy.wait_stream(cpu)
        view = accy.ArrayView(cpu, buffer, np.int32)
        assert (len(view), view.shape, view.nbytes) == (10, (10,), 40)
        taken = np.from_dlpack(consumer(view))
        assert taken.ctypes.data == view.address == buffer.address
        assert taken.tolist() == list(range(10))
        if taken.flags.writeable:  # NumPy takes legacy capsules read-only
            taken[0] = 99  # the same memory
            assert (await accy.download(cpu, buffer, np.int32))[0] == 99
        assert dlpack.exported_count() == 1
        del taken
        gc.collect()
        assert dlpack.exported_count() == 0
        cpu.destroy(buffer)


async def test_capsules_dropped_unconsumed_let_go_of_the_view() -> None:
    async with accy.open_backend("cpu") as cpu:
        buffer = cpu.allocate_buffer(64)
        view = accy.ArrayView(cpu, buffer, np.float64)
        for max_version in (None, (1, 0), (1, 3)):
            capsule = view.__dlpack__(max_version=max_version)
            assert dlpack.exported_count() == 1
            del capsule
            assert dlpack.exported_count() == 0
        cpu.destroy(buffer)


async def test_what_cannot_be_offered_is_refused() -> None:
    async with accy.open_backend("cpu") as cpu:
        buffer = cpu.allocate_buffer(16)
        with pytest.raises(accy.InvalidBuffer, match="5 elements of float32 do not fit"):
            accy.ArrayView(cpu, buffer, np.float32, 5)
        view = accy.ArrayView(cpu, buffer, np.float32)
        assert not hasattr(view, "__cuda_array_interface__")
        with pytest.raises(BufferError, match="not"):
            view.__dlpack__(dl_device=(2, 0))
        with pytest.raises(BufferError, match="copy=True"):
            view.__dlpack__(copy=True)
        with pytest.raises(BufferError, match="no type code"):
            accy.ArrayView(cpu, buffer, np.complex64).__dlpack__()
        cpu.destroy(buffer)
        with pytest.raises(BufferError, match="destroyed"):
            view.__dlpack__()
        with pytest.raises(accy.InvalidBuffer):
            accy.ArrayView(cpu, buffer, np.float32)
    async with accy.open_backend("recording") as recording:
        buffer = recording.allocate_buffer(16)
        with pytest.raises(BufferError, match="not real memory"):
            np.from_dlpack(accy.ArrayView(recording, buffer, np.float32))
        recording.destroy(buffer)


async def test_an_owned_view_frees_its_buffer_after_the_last_taker() -> None:
    async with accy.open_backend("cpu") as cpu:
        buffer = cpu.allocate_buffer(4000)
        view = accy.ArrayView(cpu, buffer, np.float32, owned=True)
        taken = np.from_dlpack(view)
        del view
        gc.collect()
        cpu.collect_deferred()
        assert cpu.owns(buffer)  # NumPy's array still holds it
        taken[:] = 1.0
        del taken
        gc.collect()
        cpu.collect_deferred()  # given up from the finalizer, released here
        await accy.wait_stream(cpu)
        cpu.collect_deferred()
        assert not cpu.owns(buffer)
        # One dropped and never collected is released when the backend closes, unwarned.
        accy.ArrayView(cpu, cpu.allocate_buffer(64), np.uint8, owned=True)
        gc.collect()


async def test_the_cpu_call_takes_views_in_place() -> None:
    async with (
        accy.open_backend("cpu") as cpu,
        accy.open_pipeline("prefix_sum_i32", backend=cpu) as scan,
    ):
        buffer = accy.upload(cpu, np.ones(1000, np.int32))
        result = cpu.allocate_buffer(4000)
        await accy.wait_stream(cpu)
        out = accy.ArrayView(cpu, result, np.int32)
        assert await scan(accy.ArrayView(cpu, buffer, np.int32), out=out) is not None
        assert (await accy.download(cpu, result, np.int32))[-1] == 1000
        cpu.destroy_all([buffer, result])


def test_a_consumer_that_refuses_a_capsule_keeps_its_error_and_nothing_leaks() -> None:
    """No capsule destructor runs Python with the consumer's error pending: sweeps stand in."""
    array = np.arange(4, dtype=np.float32)

    class ClaimsAGpu:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (dlpack.CPU, 0)

        def __dlpack__(self, **keywords: Any) -> Any:
            return dlpack.export(
                array.ctypes.data, array.dtype, array.shape, (dlpack.CUDA, 0), self, versioned=True
            )

    for _ in range(3):
        with pytest.raises(Exception) as caught:  # NumPy's own error, whatever it is
            np.from_dlpack(ClaimsAGpu())
        assert not isinstance(caught.value, SystemError)
    assert dlpack.exported_count() == 0
