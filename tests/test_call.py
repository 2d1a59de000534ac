"""The high-level call: arrays in, arrays out, on every backend that runs kernels."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import accy_async as accy


def _leftovers(backend: accy.Backend) -> dict[int, str]:
    backend.collect_deferred()
    return dict(backend.live_objects())


async def test_a_prefix_sum_takes_an_array_and_gives_one_back(
    executing_backend: accy.Backend,
) -> None:
    before = _leftovers(executing_backend)
    async with accy.open_pipeline("prefix_sum_f32", backend=executing_backend) as scan:
        for n in (1, 1000, 100_000, 5000):  # the scratch grows, then is reused
            x = np.ones(n, np.float32)
            y = await scan(x)
            assert isinstance(y, np.ndarray)
            assert y.dtype == np.float32
            assert y.shape == (n,)
            assert np.array_equal(y, np.arange(1, n + 1, dtype=np.float32))
        out = np.zeros(1000, np.float32)
        assert await scan(np.ones(1000, np.float32), out=out) is out
        assert out[-1] == 1000
    assert _leftovers(executing_backend) == before


async def test_scalars_come_from_lengths_or_by_name(executing_backend: accy.Backend) -> None:
    rng = np.random.default_rng(1)
    x, y = rng.random(777, np.float32), rng.random(777, np.float32)
    async with (
        accy.open_pipeline("saxpy_f32", backend=executing_backend) as saxpy,
        accy.open_pipeline("sum_f32", backend=executing_backend) as total,
    ):
        result = await saxpy(x, y, a=2.0)
        assert isinstance(result, np.ndarray)
        np.testing.assert_allclose(result, 2 * x + y, rtol=1e-6)
        summed = await total(np.ones(4096, np.float32))
        assert isinstance(summed, np.ndarray)
        assert summed.shape == (1,)
        assert summed[0] == 4096


@pytest.mark.parametrize(
    ("operands", "scalars", "out", "message", "path"),
    [
        (
            (np.ones(10, np.float64), np.ones(10, np.float32)),
            {"a": 1.0},
            None,
            r"operand 0 \('x'\) holds float64, the plan takes float32",
            "$.operands[0]",
        ),
        (
            (np.ones(10, np.float32),),
            {"a": 1.0},
            None,
            r"takes 2 operands \(x, y\), got 1",
            "$.operands",
        ),
        (
            (np.ones((2, 5), np.float32), np.ones(10, np.float32)),
            {"a": 1.0},
            None,
            r"shape \(2, 5\), the plan takes a 1-D array",
            "$.operands[0]",
        ),
        (
            (np.ones(20, np.float32)[::2], np.ones(10, np.float32)),
            {"a": 1.0},
            None,
            "is not contiguous",
            "$.operands[0]",
        ),
        (
            ([1.0] * 10, np.ones(10, np.float32)),
            {"a": 1.0},
            None,
            "is a list, not an array",
            "$.operands[0]",
        ),
        (
            (np.ones(10, np.float32), np.ones(12, np.float32)),
            {"a": 1.0},
            None,
            r"operands sized by 'n' differ in length \(x has 10, y has 12\)",
            "$.operands",
        ),
        (
            (np.ones(10, np.float32), np.ones(10, np.float32)),
            {},
            None,
            r"runtime scalar 'a' is not the length of an operand: pass a=",
            None,
        ),
        (
            (np.ones(10, np.float32), np.ones(10, np.float32)),
            {"a": 1.0, "b": 2},
            None,
            r"no runtime scalar named 'b'; the plan has n, a",
            None,
        ),
        (
            (np.ones(10, np.float32), np.ones(10, np.float32)),
            {"a": 1.0, "n": 11},
            None,
            r"operand 0 \('x'\) has 10 elements, the launch needs 11",
            "$.operands[0]",
        ),
        (
            (np.ones(10, np.float32), np.ones(10, np.float32)),
            {"a": 1.0},
            np.ones(9, np.float32),
            r"result 0 \('out'\) has 9 elements",
            "$.out[0]",
        ),
        (
            (np.ones(10, np.float32), np.ones(10, np.float32)),
            {"a": 1.0},
            np.ones(10, np.int32),
            r"result 0 \('out'\) holds int32",
            "$.out[0]",
        ),
    ],
)
async def test_every_mistake_is_named_before_anything_runs(
    cpu_backend: accy.CpuBackend,
    operands: tuple[Any, ...],
    scalars: dict[str, Any],
    out: Any,
    message: str,
    path: str | None,
) -> None:
    before = _leftovers(cpu_backend)
    async with accy.open_pipeline("saxpy_f32", backend=cpu_backend) as saxpy:
        with pytest.raises(accy.LaunchArgumentMismatch, match=message) as caught:
            await saxpy(*operands, out=out, **scalars)
        if path is not None:
            assert caught.value.path == path
        good = await saxpy(np.ones(3, np.float32), np.ones(3, np.float32), a=3.0)
        assert isinstance(good, np.ndarray)
        assert list(good) == [4.0, 4.0, 4.0]
    assert _leftovers(cpu_backend) == before


async def test_a_read_only_out_array_is_refused(cpu_backend: accy.CpuBackend) -> None:
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    async with accy.open_pipeline("prefix_sum_f32", backend=cpu_backend) as scan:
        with pytest.raises(accy.LaunchArgumentMismatch, match="read-only"):
            await scan(np.ones(4, np.float32), out=out)


async def test_concurrent_calls_each_get_their_own_answer(
    executing_backend: accy.Backend,
) -> None:
    sizes = [int(n) for n in np.random.default_rng(2).integers(1, 50_000, 24)]
    answers: dict[int, np.ndarray[Any, Any]] = {}
    async with accy.open_pipeline("prefix_sum_i32", backend=executing_backend, max_lanes=4) as scan:

        async def one(index: int, n: int) -> None:
            result = await scan(np.full(n, index, np.int32))
            assert isinstance(result, np.ndarray)
            answers[index] = result

        async with anyio.create_task_group() as group:
            for index, n in enumerate(sizes):
                group.start_soon(one, index, n)
    for index, n in enumerate(sizes):
        assert np.array_equal(answers[index], index * np.arange(1, n + 1, dtype=np.int32))


async def test_a_cancelled_call_returns_at_once_and_loses_nothing(
    cpu_backend: accy.CpuBackend,
) -> None:
    """Cancelled while the CPU still scans the caller's array: it stays alive until done."""
    before = _leftovers(cpu_backend)
    x = np.ones(5_000_000, np.float32)
    async with accy.open_pipeline("prefix_sum_f32", backend=cpu_backend) as scan:
        for seconds in (0.0, 0.002, 0.01):  # before the launch, and (likely) during the scan
            with anyio.move_on_after(seconds) as scope:
                await scan(x)
            assert scope.cancelled_caught or seconds  # a fast machine may finish in time
        y = await scan(np.ones(1000, np.float32))  # the call still works
        assert isinstance(y, np.ndarray)
        assert y[-1] == 1000
    await accy.synchronize(cpu_backend)
    assert _leftovers(cpu_backend) == before


async def test_a_call_cancelled_before_it_starts_takes_no_lane(
    cpu_backend: accy.CpuBackend,
) -> None:
    """In a scope cancelled already, a call is a cancellation point and nothing more: no lane
    (a stream, a thread on the CPU) is taken and given up."""
    x = np.ones(1000, np.float32)
    async with accy.open_pipeline("prefix_sum_f32", backend=cpu_backend) as scan:
        await scan(x)
        streams = sum(kind == "stream" for kind in cpu_backend.live_objects().values())
        for _ in range(20):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await scan(x)
            assert scope.cancelled_caught
        after = sum(kind == "stream" for kind in cpu_backend.live_objects().values())
        assert after == streams


async def test_result_sizes_are_what_a_call_would_fill(cpu_backend: accy.CpuBackend) -> None:
    async with accy.open_pipeline("saxpy_f32", backend=cpu_backend) as saxpy:
        x = np.ones(300, np.float32)
        assert saxpy.result_sizes(x, x, a=2.0) == (300,)
        out = np.empty(saxpy.result_sizes(x, x, a=2.0)[0], np.float32)
        await saxpy(x, x, a=2.0, out=out)
        assert out.tolist() == [3.0] * 300
        with pytest.raises(accy.LaunchArgumentMismatch, match="takes 2 operands"):
            saxpy.result_sizes(x, a=2.0)
    with pytest.raises(accy.LaunchArgumentMismatch, match="not open"):
        saxpy.result_sizes(x, x, a=2.0)


async def test_a_closed_call_refuses_and_a_plan_without_shapes_is_refused(
    cpu_backend: accy.CpuBackend,
) -> None:
    scan = accy.open_pipeline("prefix_sum_f32", backend=cpu_backend)
    with pytest.raises(accy.LaunchArgumentMismatch, match="not open"):
        await scan(np.ones(4, np.float32))
    async with scan:
        pass
    with pytest.raises(accy.LaunchArgumentMismatch, match="not open"):
        await scan(np.ones(4, np.float32))
    document = accy.library.load_builtin("prefix_sum_f32")
    bare = accy.plan.PipelineDocument(pipeline=document.pipeline, registry=document.registry)
    with pytest.raises(accy.UnsupportedOperation, match="does not describe its operands"):
        accy.open_pipeline(bare, backend=cpu_backend)


async def test_a_cancelled_close_leaves_nothing_behind(cpu_backend: accy.CpuBackend) -> None:
    before = _leftovers(cpu_backend)
    with anyio.move_on_after(0.05):
        async with accy.open_pipeline("prefix_sum_f32", backend=cpu_backend, max_lanes=4) as scan:
            async with anyio.create_task_group() as group:
                for n in (10, 1000, 100_000, 1_000_000):
                    group.start_soon(scan, np.ones(n, np.float32))
            await anyio.sleep(10)  # cancelled here: the close runs cancelled
    await accy.synchronize(cpu_backend)
    assert _leftovers(cpu_backend) == before


async def test_the_callers_arrays_are_not_kept_after_the_call(cpu_backend: accy.CpuBackend) -> None:
    async with accy.open_pipeline("prefix_sum_f32", backend=cpu_backend) as scan:
        x, out = np.ones(1000, np.float32), np.empty(1000, np.float32)
        x_ref, out_ref = weakref.ref(x), weakref.ref(out)
        await scan(x, out=out)
        del x, out
        gc.collect()
        assert x_ref() is None
        assert out_ref() is None


async def test_calls_waiting_for_a_lane_when_it_closes_say_so(cpu_backend: accy.CpuBackend) -> None:
    errors: list[str] = []
    scan = accy.open_pipeline("prefix_sum_f32", backend=cpu_backend, max_lanes=1)
    async with scan:

        async def one() -> None:
            try:
                await scan(np.ones(2_000_000, np.float32))
            except accy.LaunchArgumentMismatch as error:
                errors.append(str(error))

        async with anyio.create_task_group() as group:
            for _ in range(3):
                group.start_soon(one)
            await anyio.sleep(0.001)
            await scan.aclose()
    assert errors
    assert all("closed before this one ran" in error for error in errors), errors


async def test_numpy_scalars_empty_operands_and_odd_out(cpu_backend: accy.CpuBackend) -> None:
    x, y = np.ones(5, np.float32), np.ones(5, np.float32)
    async with accy.open_pipeline("saxpy_f32", backend=cpu_backend) as saxpy:
        result = await saxpy(x, y, a=np.float32(2), n=np.int64(5))
        assert isinstance(result, np.ndarray)
        assert list(result) == [3.0] * 5
        empty = np.ones(0, np.float32)
        with pytest.raises(accy.LaunchArgumentMismatch, match="operand 'x' is empty"):
            await saxpy(empty, empty, a=1.0)
        with pytest.raises(accy.LaunchArgumentMismatch, match="is a int, not an array") as caught:
            await saxpy(x, y, a=1.0, out=5)
        assert caught.value.path == "$.out[0]"


class HostTensor:
    """Another library's host tensor: offered through DLPack only (not a NumPy array)."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self._array = array

    def __dlpack__(self, **keywords: Any) -> Any:
        return self._array.__dlpack__(**keywords)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


async def test_host_tensors_offered_through_dlpack_are_used_in_place(
    cpu_backend: accy.CpuBackend,
) -> None:
    x, out = np.ones(1000, np.float32), np.zeros(1000, np.float32)
    async with accy.open_pipeline("prefix_sum_f32", backend=cpu_backend) as scan:
        y = await scan(HostTensor(x))
        assert isinstance(y, np.ndarray)
        assert y[-1] == 1000
        written = await scan(HostTensor(x), out=HostTensor(out))
        assert np.shares_memory(written, out)
        assert out[-1] == 1000
        with pytest.raises(accy.LaunchArgumentMismatch, match="holds float64"):
            await scan(HostTensor(np.ones(4, np.float64)))


async def test_a_negative_zero_scalar_is_not_taken_for_a_cached_zero(
    cpu_backend: accy.CpuBackend,
) -> None:
    x, y = np.ones(4, np.float32), np.full(4, -0.0, np.float32)
    async with accy.open_pipeline("saxpy_f32", backend=cpu_backend) as saxpy:
        for a in (-0.0, 0.0, -0.0, accy.F32(0.0), accy.F32(-0.0)):
            value = a.value if isinstance(a, accy.F32) else a
            result = await saxpy(x, y, a=a)
            assert list(np.signbit(result)) == [math.copysign(1.0, value) < 0] * 4, a
