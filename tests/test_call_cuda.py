"""The high-level call with PyTorch and CuPy arrays on CUDA: zero-copy, ordered by streams."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async._call_replay import Replay

from .conftest import needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.fixture
async def cuda() -> AsyncIterator[accy.Backend]:
    async with accy.open_backend("cuda") as backend:
        yield backend


def _torch() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here")
    return torch


async def test_torch_in_torch_out_ordered_by_streams_without_a_host_sync(
    cuda: accy.Backend,
) -> None:
    """The producer is still sleeping on its stream when the call returns; nothing races."""
    torch = _torch()
    n = 1_000_000
    side = torch.cuda.Stream()
    async with accy.open_pipeline("prefix_sum_f32", backend=cuda) as scan:
        for trial in range(20):
            value = float(trial % 3 + 1)
            with torch.cuda.stream(side):
                x = torch.empty(n, device="cuda")
                torch.cuda._sleep(2_000_000)  # the fill lands ~1 ms later, on `side`
                x.fill_(value)
                y = await scan(x)  # ordered after `side`; `side` ordered after the scan
                assert isinstance(y, torch.Tensor)
                assert y.device == x.device
                assert y.dtype == torch.float32
                last = y[-1].item()  # read on `side`
            assert last == value * n, trial
        out = torch.empty(n, device="cuda")
        pointer = out.data_ptr()
        x = torch.ones(n, device="cuda")
        assert await scan(x, out=out) is out
        assert out.data_ptr() == pointer
        assert out[-1].item() == n


async def test_cupy_in_cupy_out(cuda: accy.Backend) -> None:
    cupy = pytest.importorskip("cupy")
    async with accy.open_pipeline("saxpy_f32", backend=cuda) as saxpy:
        for n in (1, 1000, 1_000_003):
            x = cupy.arange(n, dtype=cupy.float32)
            y = cupy.ones(n, dtype=cupy.float32)
            result = await saxpy(x, y, a=2.0)
            assert isinstance(result, cupy.ndarray)
            expected = 2 * np.arange(n, dtype=np.float32) + 1
            np.testing.assert_allclose(cupy.asnumpy(result), expected, rtol=1e-6)


async def test_numpy_and_device_arrays_mix_and_leases_end(cuda: accy.Backend) -> None:
    torch = _torch()
    async with accy.open_pipeline("saxpy_f32", backend=cuda) as saxpy:
        x = torch.ones(4096, device="cuda")
        x_ref = weakref.ref(x)
        host_y = np.full(4096, 3, np.float32)
        result = await saxpy(x, host_y, a=2.0)  # a device operand: a device result
        assert isinstance(result, torch.Tensor)
        assert result.cpu().numpy().tolist() == [5.0] * 4096
        host_out = np.empty(4096, np.float32)
        assert await saxpy(x, host_y, a=1.0, out=host_out) is host_out  # NumPy out: waited for
        assert host_out.tolist() == [4.0] * 4096
        del x, result
    await accy.synchronize(cuda)
    for _ in range(200):  # the reactor reports the lane's stream idle a moment later
        cuda.collect_deferred()
        gc.collect()
        if x_ref() is None:
            break
        await anyio.sleep(0.005)
    assert x_ref() is None  # the lease ended with the work


async def test_device_array_mistakes_are_named(cuda: accy.Backend) -> None:
    torch = _torch()
    async with (
        accy.open_pipeline("prefix_sum_f32", backend=cuda) as scan,
        accy.open_backend("cpu") as cpu,
        accy.open_pipeline("prefix_sum_f32", backend=cpu) as cpu_scan,
    ):
        cases = [
            (scan, torch.ones(10, device="cuda", dtype=torch.float64), "holds float64"),
            (scan, torch.ones((2, 5), device="cuda"), r"shape \(2, 5\)"),
            (scan, torch.ones(20, device="cuda")[::2], "not contiguous"),
            (scan, torch.ones(10, device="cuda", requires_grad=True), "operand 0"),
            (cpu_scan, torch.ones(10, device="cuda"), "the cpu backend takes NumPy arrays"),
        ]
        for call, operand, message in cases:
            with pytest.raises(accy.LaunchArgumentMismatch, match=message):
                await call(operand)
        y = await scan(torch.ones(10, device="cuda"))
        assert y[-1].item() == 10


class DLPackOnly:
    """A GPU tensor offered through DLPack only, as JAX and cuda.core offer theirs."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def __dlpack__(self, **keywords: Any) -> Any:
        return self._tensor.__dlpack__(**keywords)

    def __dlpack_device__(self) -> tuple[int, int]:
        device: tuple[int, int] = self._tensor.__dlpack_device__()
        return device


async def test_gpu_tensors_offered_through_dlpack_only(cuda: accy.Backend) -> None:
    torch = _torch()
    n = 100_000
    async with accy.open_pipeline("prefix_sum_f32", backend=cuda) as scan:
        x = torch.ones(n, device="cuda")
        out = torch.empty(n, device="cuda")
        assert await scan(DLPackOnly(x), out=out) is out
        assert out[-1].item() == n
        y = await scan(DLPackOnly(x))  # no way to make theirs: an ArrayView, offering DLPack
        assert isinstance(y, accy.ArrayView)
        assert torch.from_dlpack(y)[-1].item() == n
        with pytest.raises(accy.LaunchArgumentMismatch, match="holds float64"):
            await scan(DLPackOnly(torch.ones(8, device="cuda", dtype=torch.float64)))


async def test_results_taken_by_torch_and_cupy_without_a_copy_on_their_streams(
    cuda: accy.Backend,
) -> None:
    """The consumer's stream waits for the scan on the device; the result outlives ``del``."""
    torch = _torch()
    cupy = pytest.importorskip("cupy")
    n = 1_000_000
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    async with accy.open_pipeline("prefix_sum_f32", backend=cuda) as scan:
        for trial in range(30):
            value = float(trial % 5 + 1)
            with torch.cuda.stream(producer):  # PyTorch hands tensors over on its current stream
                x = torch.empty(n, device="cuda")
                torch.cuda._sleep(1_000_000)  # the operand lands late: so does the scan
                x.fill_(value)
                y = await scan(DLPackOnly(x))
            with torch.cuda.stream(consumer):
                t = torch.from_dlpack(y)  # `consumer` now waits for the scan, on the device
                assert t.data_ptr() == y.address
                last = t[-1].item()
            assert last == value * n, trial
        with cupy.cuda.Stream(non_blocking=True):
            c = cupy.from_dlpack(y)
            assert c.data.ptr == y.address
            assert float(c[-1]) == last
        assert cupy.asarray(y).data.ptr == y.address  # the CUDA Array Interface
        # The tensor keeps the memory: dropping the view frees nothing.
        address = y.address
        del y, c
        gc.collect()
        for _ in range(3):
            z = await scan(DLPackOnly(torch.full((n,), 7.0, device="cuda")))
            assert z.address != address
        assert t[-1].item() == last
        del t, z
        gc.collect()
        assert accy.dlpack.exported_count() == 0
    for _ in range(200):  # the leases end once the reactor reports the lanes idle
        cuda.collect_deferred()  # and what the views gave up (from whichever thread) goes
        buffers = list(cuda.live_objects(owned_only=True).values())
        if "buffer" not in buffers:
            break
        await anyio.sleep(0.005)
    assert "buffer" not in buffers


async def test_streams_of_other_libraries_are_taken_where_a_stream_is(cuda: accy.Backend) -> None:
    torch = _torch()
    core = pytest.importorskip("cuda.core")
    document = accy.library.load_builtin("prefix_sum_f32")
    n = 100_000
    x = accy.upload(cuda, np.ones(n, np.float32))
    y = cuda.allocate_buffer(4 * n)
    arguments = document.pipeline.validate_runtime_scalar_arguments([n])
    pool = await accy.load_pipeline_artifacts(cuda, document.pipeline, document.registry)
    scratch = await accy.allocate_pipeline_intermediates(cuda, document.pipeline, arguments)
    device = core.Device(0)
    device.set_current()
    streams: list[Any] = [torch.cuda.Stream(), device.create_stream()]
    for stream in streams:
        cuda.fill_buffer(y, 0, stream=stream)
        request = accy.PipelineLaunch.of(
            document,
            operands=(x.bind("read_only"),),
            results=(y.bind(),),
            runtime_scalar_arguments=arguments,
            intermediates=scratch,
            artifacts=pool,
            stream=stream,
        )
        await accy.launch_pipeline(cuda, request)
        await accy.wait_stream(cuda, stream)
        values = await accy.download(cuda, y, np.float32, n, stream=stream)
        assert values[-1] == n
    # Ours taken by theirs: cuda.core wraps it, PyTorch runs on it.
    ours = cuda.create_stream()
    handle = ours.__cuda_stream__()[1]
    assert int(device.create_stream(ours).handle) == handle
    with torch.cuda.stream(torch.cuda.ExternalStream(handle)):
        t = torch.ones(n, device="cuda") * 2
    await accy.wait_stream(cuda, ours)
    assert t.sum().item() == 2 * n
    await pool.aclose()
    await scratch.aclose()
    cuda.destroy_all([x, y, ours])
    assert all(kind != "stream" for kind in cuda.live_objects(owned_only=True).values())


async def test_torch_calls_replayed_into_out_stay_ordered_after_their_producers(
    cuda: accy.Backend,
) -> None:
    """The same tensors called again are replayed, still in stream order.

    Each trial's producer sleeps on the stream before it fills the operand with a new
    value; a replay that ran before it, or on another stream, reads the old value.
    """
    torch = _torch()
    n = 1_000_000
    async with accy.open_pipeline("prefix_sum_f32", backend=cuda, max_lanes=1) as scan:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x, out = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
            for trial in range(20):
                value = float(trial % 3 + 1)
                torch.cuda._sleep(2_000_000)  # the fill lands ~1 ms later, on `side`
                x.fill_(value)
                assert await scan(x, out=out) is out
                assert out[-1].item() == value * n, trial
        (lane,) = scan._free
        assert sum(isinstance(each, Replay) for each in lane.replays.values()) == 1


async def test_cupy_calls_replayed_into_out_stay_ordered_after_their_producers(
    cuda: accy.Backend,
) -> None:
    """The same with CuPy arrays on a CuPy stream, each fill behind a few ms of other work."""
    cupy = pytest.importorskip("cupy")
    n = 1_000_000
    async with accy.open_pipeline("prefix_sum_f32", backend=cuda, max_lanes=1) as scan:
        theirs = cupy.cuda.Stream(non_blocking=True)
        with theirs:
            busy = cupy.ones(50_000_000, dtype=cupy.float32)
            a, b = cupy.empty(n, dtype=cupy.float32), cupy.empty(n, dtype=cupy.float32)
            for trial in range(20):
                value = float(trial % 3 + 1)
                for _ in range(10):  # about 2 ms of work queued before the fill
                    busy += 1.0
                a.fill(value)
                assert await scan(a, out=b) is b
                assert float(b[-1]) == value * n, trial
        (lane,) = scan._free
        assert sum(isinstance(each, Replay) for each in lane.replays.values()) == 1
