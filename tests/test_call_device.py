"""The high-level call's device path, decided and ordered: checked on the recording backend.

The arrays here are what the call sees of a GPU array, the CUDA Array Interface and
nothing behind it; the recording backend notes every launch, record, wait and foreign
ordering, and completes nothing until told (``completion="manual"``). The same paths run
for real on the H200 in ``test_call_cuda.py``.
"""

from __future__ import annotations

import gc
import math
import random
import weakref
from typing import Any

import numpy as np
import pytest

import accy_async as accy
from accy_async import plan as p
from accy_async._call_replay import Replay
from accy_async.testing import assert_checkpoint

A, B, C = 0x7A00, 0x7B00, 0x7C00


class DeviceArray:
    """A float32 GPU array as a library offers it: ``__cuda_array_interface__`` naming a stream."""

    def __init__(self, n: int, stream: int, address: int = 0x1_0000) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (address, False),
            "version": 3,
            "stream": stream,
        }


class Stream:
    """A stream of another library (cuda.core's protocol)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def leased(backend: accy.Backend) -> int:
    """How many buffers over callers' arrays are alive."""
    owned = backend.live_objects(owned_only=True)
    return sum(
        1 for key, kind in backend.live_objects().items() if kind == "buffer" and key not in owned
    )


async def test_arrays_of_one_stream_run_there_held_until_their_work_is_done() -> None:
    backend = accy.RecordingBackend(completion="manual")
    async with accy.open_pipeline("saxpy_f32", backend=backend) as saxpy:
        held: list[weakref.ref[DeviceArray]] = []
        for _ in range(3):
            x, y, out = DeviceArray(256, A), DeviceArray(256, A), DeviceArray(256, A)
            assert await saxpy(x, y, a=2.0, out=out) is out
            held.extend(weakref.ref(each) for each in (x, y, out))
            del x, y, out
        theirs = backend.adopt_stream(A)
        assert {launch.stream_id for launch in backend.launches} == {theirs.id}
        assert backend.foreign_orders == []  # stream order is all the ordering needed
        gc.collect()
        assert all(ref() is not None for ref in held)  # their work has not completed
        assert leased(backend) == 0  # nor were they registered with the backend
        backend.complete_all()
        await saxpy(DeviceArray(256, A), DeviceArray(256, A), a=2.0, out=DeviceArray(256, A))
        gc.collect()
        assert all(ref() is None for ref in held)  # found done by this call: let go
        backend.complete_all()
    await backend.aclose()


async def test_a_lane_moving_to_another_stream_waits_for_its_last_call() -> None:
    backend = accy.RecordingBackend(completion="manual")
    async with accy.open_pipeline("saxpy_f32", backend=backend, max_lanes=1) as saxpy:
        await saxpy(DeviceArray(64, A), DeviceArray(64, A), a=1.0, out=DeviceArray(64, A))
        on_a, on_b = backend.adopt_stream(A), backend.adopt_stream(B)
        (done, recorded_on), *_ = backend.records
        assert recorded_on == on_a.id
        await saxpy(DeviceArray(64, B), DeviceArray(64, B), a=1.0, out=DeviceArray(64, B))
        assert (on_b.id, done) in backend.waits  # the scratch and lane were in use on A
        assert backend.launches[-1].stream_id == on_b.id
        backend.complete_all()
    await backend.aclose()


async def test_arrays_of_several_streams_run_on_the_lane_ordered_both_ways() -> None:
    backend = accy.RecordingBackend(completion="manual")
    async with accy.open_pipeline("saxpy_f32", backend=backend) as saxpy:
        await saxpy(DeviceArray(64, A), DeviceArray(64, B), a=1.0, out=DeviceArray(64, A))
        lane = backend.launches[-1].stream_id
        assert lane not in (backend.adopt_stream(A).id, backend.adopt_stream(B).id)
        assert backend.foreign_orders == [
            ("follow", lane, A),
            ("follow", lane, B),
            ("lead", A, lane),
        ]
        backend.complete_all()
    await backend.aclose()


async def test_a_given_stream_is_where_everything_runs() -> None:
    backend = accy.RecordingBackend(completion="manual")
    async with accy.open_pipeline("saxpy_f32", backend=backend) as saxpy:
        x, y, out = DeviceArray(64, A), DeviceArray(64, B), DeviceArray(64, A)
        await saxpy(x, y, a=1.0, out=out, stream=Stream(C))
        assert backend.launches[-1].stream_id == backend.adopt_stream(C).id
        assert backend.foreign_orders == []
        with pytest.raises(accy.InvalidBuffer, match="not a stream"):
            await saxpy(x, y, a=1.0, out=out, stream="C")  # type: ignore[arg-type]
        backend.complete_all()
    await backend.aclose()


async def test_a_launch_failing_midway_on_a_callers_stream_frees_nothing_early() -> None:
    """Stages already queued there may still run: the lane's objects wait for them."""
    backend = accy.RecordingBackend(completion="manual", fail_after={"launch": 1})
    call: Any = accy.open_pipeline("prefix_sum_f32", backend=backend)
    async with call as scan:
        n = 100_000
        with pytest.raises(accy.RuntimeUnavailable):
            await scan(DeviceArray(n, A), out=DeviceArray(n, A))
        theirs = backend.adopt_stream(A)
        assert [launch.stream_id for launch in backend.launches] == [theirs.id]
        done, recorded_on = backend.records[-1]
        assert recorded_on == theirs.id  # after the stage that did go
        # The lane's own stream waits for that record: whatever waits for the lane covers it.
        assert [event for stream, event in backend.waits if stream != theirs.id] == [done]
        scratch = [key for key, kind in backend.live_objects(owned_only=True).items()]
        backend.collect_deferred()
        assert all(key in backend.live_objects() for key in scratch)  # nothing freed yet
        backend.complete_all()
        backend.collect_deferred()
        assert leased(backend) == 0
    await backend.aclose()


async def test_outgrown_device_copies_go_with_the_lane_when_the_call_closes() -> None:
    """Copies of NumPy operands grow with the requests; closing leaves nothing to collect."""
    backend = accy.RecordingBackend(completion="manual")
    before = dict(backend.live_objects())
    async with accy.open_pipeline("saxpy_f32", backend=backend) as saxpy:
        for n in (10, 1000, 100_000):
            ones = np.ones(n, np.float32)
            await saxpy(ones, ones, a=1.0, out=DeviceArray(n, A))
        backend.complete_all()
    assert dict(backend.live_objects()) == before
    await backend.aclose()


async def test_a_call_on_device_arrays_is_a_checkpoint() -> None:
    """On the caller's stream and on a given one, its work done at once or not."""
    backend = accy.RecordingBackend()
    async with accy.open_pipeline("saxpy_f32", backend=backend) as saxpy:
        x, y, out = DeviceArray(64, A), DeviceArray(64, A), DeviceArray(64, A)
        await assert_checkpoint(lambda: saxpy(x, y, a=1.0, out=out))
        await assert_checkpoint(lambda: saxpy(x, y, a=1.0, out=out, stream=Stream(C)))
        await assert_checkpoint(lambda: accy.wait_stream(backend, Stream(C)))
    await backend.aclose()


async def test_calls_like_earlier_ones_launch_what_each_asks_for() -> None:
    """A call whose arrays, scalars and stream were seen twice on its lane is replayed.

    Every variation (an address, a length, a scalar's value or the sign of its zero, the
    arrays' stream, a given stream) must still launch as asked, in any order.
    """
    backend = accy.RecordingBackend()
    places = [(0x1000, 0x2000, 0x3000), (0x1000, 0x2000, 0x4000), (0x2000, 0x1000, 0x3000)]
    asks = [
        (n, a, place, theirs, given)
        for n in (64, 65)
        for a in (-0.0, 0.0)
        for place in places
        for theirs in (A, B)
        for given in (None, C)
    ]
    order = asks * 3
    random.Random(5).shuffle(order)
    async with accy.open_pipeline("saxpy_f32", backend=backend, max_lanes=1) as saxpy:
        for n, a, (x_at, y_at, out_at), theirs, given in order:
            x, y = DeviceArray(n, theirs, x_at), DeviceArray(n, theirs, y_at)
            out = DeviceArray(n, theirs, out_at)
            stream = None if given is None else Stream(given)
            assert await saxpy(x, y, a=a, out=out, stream=stream) is out
            launch = backend.launches[-1]
            assert launch.buffer_addresses == (out_at, x_at, y_at)
            assert launch.scalars == (p.U32(n), p.F32(a))
            assert math.copysign(1.0, launch.scalars[1].value) == math.copysign(1.0, a)
            assert launch.stream_id == backend.adopt_stream(given or theirs).id
        (lane,) = saxpy._free
        assert sum(isinstance(each, Replay) for each in lane.replays.values()) == len(asks)
    await backend.aclose()


async def test_a_replayed_call_is_checked_where_it_differs() -> None:
    """Another dtype, too few elements or a forgotten stream: not the replay, the checks."""
    backend = accy.RecordingBackend()
    async with accy.open_pipeline("saxpy_f32", backend=backend, max_lanes=1) as saxpy:
        x, y, out = DeviceArray(64, A), DeviceArray(64, A, 0x2000), DeviceArray(64, A, 0x3000)
        for _ in range(3):
            await saxpy(x, y, a=1.0, out=out)
        (lane,) = saxpy._free
        assert [isinstance(each, Replay) for each in lane.replays.values()] == [True]
        await assert_checkpoint(lambda: saxpy(x, y, a=1.0, out=out))  # a replay
        launches = backend.launch_count
        wide = DeviceArray(64, A, 0x3000)
        wide.__cuda_array_interface__["typestr"] = "<f8"
        with pytest.raises(accy.LaunchArgumentMismatch, match="float64"):
            await saxpy(x, y, a=1.0, out=wide)
        with pytest.raises(accy.LaunchArgumentMismatch, match="has 63 elements"):
            await saxpy(x, y, a=1.0, out=DeviceArray(63, A, 0x3000))
        assert backend.launch_count == launches
        backend.destroy(backend.adopt_stream(A))  # forgotten: the next call adopts it anew
        await saxpy(x, y, a=1.0, out=out)
        assert backend.launches[-1].stream_id == backend.adopt_stream(A).id
    await backend.aclose()


@pytest.mark.parametrize(
    ("item", "value", "replayed"),
    [
        ("descr", [("", "<f4")], [True]),  # CuPy's: a list the call never reads, nor keys
        ("shape", [64], []),  # read as a tuple, but unhashable here: no replay
    ],
)
async def test_what_an_interface_holds_beyond_its_reads_decides_the_replay(
    item: str, value: object, replayed: list[bool]
) -> None:
    backend = accy.RecordingBackend()
    async with accy.open_pipeline("saxpy_f32", backend=backend, max_lanes=1) as saxpy:
        arrays = [DeviceArray(64, A, address) for address in (0x1000, 0x2000, 0x3000)]
        for each in arrays:
            each.__cuda_array_interface__[item] = value
        for _ in range(3):
            assert await saxpy(arrays[0], arrays[1], a=1.0, out=arrays[2]) is arrays[2]
        assert backend.launch_count == 3
        (lane,) = saxpy._free
        assert [isinstance(each, Replay) for each in lane.replays.values()] == replayed
    await backend.aclose()


async def test_a_replayed_call_gives_back_and_takes_what_the_checked_call_does() -> None:
    """``out=`` as a list or tuple, NumPy scalars (a zero's sign kept), and an array whose
    interface raises: the same answer, replayed or not."""
    backend = accy.RecordingBackend()
    async with accy.open_pipeline("saxpy_f32", backend=backend, max_lanes=1) as saxpy:
        x, y, out = DeviceArray(64, A), DeviceArray(64, A, 0x2000), DeviceArray(64, A, 0x3000)
        for given in ([out], (out,), out):
            assert [await saxpy(x, y, a=1.0, out=given) for _ in range(4)] == [out] * 4
        for a in (np.float32(0.0), np.float32(-0.0), np.float64(-0.0), np.float64(0.0)):
            for _ in range(3):
                await saxpy(x, y, a=a, out=out)
                (_, scale) = backend.launches[-1].scalars
                assert math.copysign(1.0, scale.value) == math.copysign(1.0, float(a))

        class Refusing:
            @property
            def __cuda_array_interface__(self) -> dict[str, Any]:
                raise RuntimeError("cannot export a tensor that requires grad")

        for _ in range(2):
            with pytest.raises(accy.LaunchArgumentMismatch, match="requires grad"):
                await saxpy(Refusing(), y, a=1.0, out=out)
    await backend.aclose()


async def test_a_wrong_array_is_named_before_a_wrong_stream() -> None:
    backend = accy.RecordingBackend()
    async with accy.open_pipeline("saxpy_f32", backend=backend, max_lanes=1) as saxpy:
        x, y, out = DeviceArray(64, A), DeviceArray(64, A, 0x2000), DeviceArray(64, A, 0x3000)
        await saxpy(x, y, a=1.0, out=out)  # a free lane: the call looks for a replay first
        wide = DeviceArray(64, A)
        wide.__cuda_array_interface__["typestr"] = "<f8"
        with pytest.raises(accy.LaunchArgumentMismatch, match=r"operand 0"):
            await saxpy(wide, y, a=1.0, out=out, stream="C")  # type: ignore[arg-type]
        with pytest.raises(accy.InvalidBuffer, match="not a stream"):
            await saxpy(x, y, a=1.0, out=out, stream="C")  # type: ignore[arg-type]
    await backend.aclose()
