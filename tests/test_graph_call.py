"""The high-level graph call: slots in as arrays, slots out as arrays, on every executing backend.

A launch-graph document runs with its dataflow graph or its own (two streams,
a loop), for many calls and concurrent ones on reused lanes, with the kernels'
u32 count buffers made by the call; bad input is refused naming the slot
before anything is allocated; a cancelled call and a close leave nothing alive.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async import plan as p
from accy_async.arrays import ArrayView
from accy_async.testing import live_after_drain

from .plans import (
    artifact_plan,
    elementwise,
    elementwise_kernels,
    fill_by_buffer_count,
    geometry,
    planned,
)
from .test_graph import ping_pong

N = 1000


def diamond_document(
    backend: accy.Backend, graph: p.LaunchGraphPlan | None
) -> p.LaunchGraphDocument:
    """Slot 1 -> copy to 2, add one to 3 -> their sum into 4 (= 2 * x + 1)."""
    slots = tuple(p.Slot(slot_id=i, byte_size=4 * N, dtype=p.DType.F32) for i in range(1, 5))
    plan = p.ArtifactPlan(slots=slots, kernels=elementwise_kernels(backend, N))
    return p.LaunchGraphDocument(artifact_plan=plan, graph=graph)


TWO_STREAMS = p.LaunchGraphPlan(
    nodes=(
        p.GraphNode(kernel_index=0, stream=0),
        p.GraphNode(kernel_index=1, stream=1),
        p.GraphNode(kernel_index=2, stream=0),
    ),
    dependencies=(
        p.GraphDependency(producer_node_index=0, consumer_node_index=2),
        p.GraphDependency(producer_node_index=1, consumer_node_index=2),
    ),
    stream_count=2,
)


@pytest.mark.parametrize("graph", [None, TWO_STREAMS], ids=["dataflow", "two streams"])
async def test_slots_in_and_out_over_many_and_concurrent_calls(
    executing_backend: accy.Backend, graph: p.LaunchGraphPlan | None
) -> None:
    backend = executing_backend
    rng = np.random.default_rng(7)
    async with accy.open_graph(diamond_document(backend, graph), backend=backend) as run:
        for _ in range(3):  # a relaunch reuses the lane (and on CUDA the device graph)
            x = rng.standard_normal(N).astype(np.float32)
            out = await run({1: x})
            assert sorted(out) == [2, 3, 4]  # each kernel's output slot by default
            np.testing.assert_array_equal(out[2], x)
            np.testing.assert_array_equal(out[3], x + 1)
            np.testing.assert_array_equal(out[4], x + (x + 1))
        inputs = [rng.standard_normal(N).astype(np.float32) for _ in range(12)]
        got: dict[int, np.ndarray] = {}

        async def one(index: int) -> None:
            got[index] = (await run({1: inputs[index]}, read=[4]))[4]

        async with anyio.create_task_group() as tasks:
            for index in range(len(inputs)):
                tasks.start_soon(one, index)
        for index, x in enumerate(inputs):
            np.testing.assert_array_equal(got[index], x + (x + 1))
    assert await live_after_drain(backend) == {}


async def test_a_loop_and_count_buffers_made_by_the_call(executing_backend: accy.Backend) -> None:
    backend = executing_backend
    # Kernel 0 fills slot 1 with 7 as far as its u32 count buffer says (the plan's 600);
    # kernel 4 adds one to slot 5 into 6, carried three times (slots 1 and 6 taking turns as
    # the output): 7 + 3 where counted, 3 after, every call (each starts from zeroed slots).
    plan = artifact_plan(
        {1: 4 * N, 5: 4 * N, 6: 4 * N},
        fill_by_buffer_count(
            backend,
            0,
            1,
            0x40E00000,
            element_count_argument_value=600,
            launch_resources=geometry(N),
        ),
        *(elementwise(backend, k, "copy_f32", 5, (1,), N) for k in (1, 2, 3)),
        elementwise(backend, 4, "add_one_f32", 6, (5,), N),
    )
    document = p.LaunchGraphDocument(artifact_plan=plan, graph=ping_pong(3))
    async with accy.open_graph(document, backend=backend) as run:
        for _ in range(2):
            out = await run(read=[1, 6])
            assert out[1].dtype == np.uint8  # the slots state no dtype: bytes
            values = out[6].view(np.float32)
            np.testing.assert_array_equal(values[:600], 10.0)
            np.testing.assert_array_equal(values[600:], 3.0)
    assert await live_after_drain(backend) == {}


async def test_bad_input_is_refused_naming_the_slot_before_anything_is_made(
    cpu_backend: accy.CpuBackend,
) -> None:
    backend = cpu_backend
    x = np.ones(N, np.float32)
    document = diamond_document(backend, None)
    typed = p.LaunchGraphDocument(
        artifact_plan=p.ArtifactPlan(
            slots=(*document.artifact_plan.slots[:1], p.Slot(slot_id=9, dtype=p.DType.U32)),
            kernels=(),
        )
    )
    async with accy.open_graph(document, backend=backend) as run:
        before = await live_after_drain(backend)
        cases: list[tuple[Any, list[int] | None, str, str]] = [
            ({7: x}, None, r"\$\.inputs\[7\]", "not a slot"),
            ({1: x.astype(np.float64)}, None, r"\$\.inputs\[1\]", "holds f32"),
            ({1: x[:10]}, None, r"\$\.inputs\[1\]", "holds 4000 bytes"),
            ({1: np.ones((2, N), np.float32)[:, 0]}, None, r"\$\.inputs\[1\]", "contiguous"),
            ({1: list(x)}, None, r"\$\.inputs\[1\]", "expected a NumPy array"),
            ({1: x}, [8], r"\$\.read", "not a slot"),
        ]
        for inputs, read, path, message in cases:
            with pytest.raises(accy.LaunchArgumentMismatch, match=message) as raised:
                await run(inputs, read=read)
            assert raised.value.path is not None
            assert re.fullmatch(path, raised.value.path)
        assert await live_after_drain(backend) == before  # no lane, no buffer was made
    async with accy.open_graph(typed, backend=backend) as run:
        with pytest.raises(accy.LaunchArgumentMismatch, match="slot 9 has no byte_size"):
            await run({1: x})
        with pytest.raises(accy.LaunchArgumentMismatch, match="slot 9 holds u32"):
            await run({1: x, 9: x})
        out = await run({1: x, 9: np.arange(5, dtype=np.uint32)}, read=[9])
        np.testing.assert_array_equal(out[9], np.arange(5))  # no kernel: what was given
    with pytest.raises(accy.LaunchArgumentMismatch, match="not open"):
        await run({1: x})
    assert await live_after_drain(backend) == {}


async def test_a_cancelled_call_returns_at_once_and_leaves_nothing(
    executing_backend: accy.Backend,
) -> None:
    backend = executing_backend
    slow = planned(
        backend,
        0,
        "slow_fill_f32",
        1,
        scalars=(p.U32(N), p.F32(3.0), p.U64(1_000_000_000)),
    )
    plan = artifact_plan(
        {1: 4 * N, 2: 4 * N}, slow, elementwise(backend, 1, "copy_f32", 2, (1,), N)
    )
    document = p.LaunchGraphDocument(artifact_plan=plan)
    async with accy.open_graph(document, backend=backend) as run:
        started = anyio.current_time()
        with anyio.move_on_after(0.05) as scope:
            await run()
        assert scope.cancelled_caught
        assert anyio.current_time() - started < 0.8  # not after the 1 s kernel
    assert await live_after_drain(backend) == {}


@pytest.mark.gpu
async def test_device_arrays_in_and_out_on_cuda(executing_backend: accy.Backend) -> None:
    backend = executing_backend
    if backend.kind != "cuda":
        pytest.skip("device arrays are the CUDA backend's")
    x = np.arange(N, dtype=np.float32)
    async with accy.open_graph(diamond_document(backend, TWO_STREAMS), backend=backend) as run:
        kept = (await run({1: x}, read=[3], device=True))[3]
        assert isinstance(kept, ArrayView)
        out = await run({1: kept}, read=[4])  # x + 1 in, on the device
        np.testing.assert_array_equal(out[4], (x + 1) + (x + 2))
        del kept
    assert await live_after_drain(backend) == {}


def slow_document(backend: accy.Backend, spin_ns: int) -> p.LaunchGraphDocument:
    """Kernel 0 fills slot 1 with 3.0 after spinning ``spin_ns``; kernel 1 copies it to 2."""
    slow = planned(backend, 0, "slow_fill_f32", 1, scalars=(p.U32(N), p.F32(3.0), p.U64(spin_ns)))
    copy = elementwise(backend, 1, "copy_f32", 2, (1,), N)
    return p.LaunchGraphDocument(artifact_plan=artifact_plan({1: 4 * N, 2: 4 * N}, slow, copy))


async def test_a_close_waits_for_the_call_in_flight_and_refuses_the_waiting_ones(
    cpu_backend: accy.CpuBackend,
) -> None:
    backend = cpu_backend
    run = accy.open_graph(slow_document(backend, 200_000_000), backend=backend, max_lanes=1)
    await run.__aenter__()
    outcomes: dict[str, Any] = {}

    async def call(name: str) -> None:
        try:
            outcomes[name] = (await run(read=[2]))[2]
        except accy.LaunchArgumentMismatch as error:
            outcomes[name] = error

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(call, "in flight")
        await anyio.sleep(0.05)
        tasks.start_soon(call, "waiting")  # for the one lane
        await anyio.sleep(0.05)
        await run.aclose()
        assert "in flight" in outcomes  # the close waited for it
    np.testing.assert_array_equal(outcomes["in flight"].view(np.float32), 3.0)
    assert "closed before this one ran" in str(outcomes["waiting"])
    assert await live_after_drain(backend) == {}


async def test_graphs_a_call_cannot_run_are_refused_on_entering(
    cpu_backend: accy.CpuBackend,
) -> None:
    backend = cpu_backend
    signals = p.LaunchGraphPlan(
        nodes=(p.GraphNode(kernel_index=0), p.GraphNode(kernel_index=1, signal_event=0)),
        event_count=1,
    )
    document = p.LaunchGraphDocument(
        artifact_plan=slow_document(backend, 0).artifact_plan, graph=signals
    )
    with pytest.raises(accy.UnsupportedOperation) as raised:
        async with accy.open_graph(document, backend=backend):
            pass
    assert raised.value.path == "$.graph.event_count"
    assert await live_after_drain(backend) == {}  # nothing was loaded


async def test_slot_ids_are_whole_numbers_and_views_must_be_live(
    cpu_backend: accy.CpuBackend,
) -> None:
    backend = cpu_backend
    x = np.arange(N, dtype=np.float32)
    async with accy.open_graph(diamond_document(backend, None), backend=backend) as run:
        out = await run({np.int64(1): x}, read=[np.int32(4)])
        assert list(out) == [4] and type(next(iter(out))) is int
        np.testing.assert_array_equal(out[4], x + (x + 1))
        for inputs, read in (({True: x}, None), ({"1": x}, None), ({1: x}, "4"), ({1: x}, 4)):
            with pytest.raises(accy.LaunchArgumentMismatch):
                await run(inputs, read=read)  # type: ignore[arg-type]
        view = ArrayView(backend, backend.allocate_buffer(4 * N), np.float32)
        backend.destroy(view.buffer)
        with pytest.raises(accy.LaunchArgumentMismatch, match="not a live array") as raised:
            await run({1: view})
        assert raised.value.path == "$.inputs[1]"
    assert await live_after_drain(backend) == {}


def spread_document(backend: accy.Backend, devices: tuple[int, int, int]) -> p.LaunchGraphDocument:
    """The diamond's three kernels, node ``i`` on device ``devices[i]``: copy 1 -> 2, add one
    1 -> 3, add 2 + 3 -> 4 (= 2 * x + 1)."""
    document = diamond_document(backend, None)
    graph = p.LaunchGraphPlan(
        nodes=tuple(p.GraphNode(kernel_index=i, device=d) for i, d in enumerate(devices)),
        dependencies=(
            p.GraphDependency(producer_node_index=0, consumer_node_index=2),
            p.GraphDependency(producer_node_index=1, consumer_node_index=2),
        ),
        device_count=max(devices) + 1,
    )
    return p.LaunchGraphDocument(artifact_plan=document.artifact_plan, graph=graph)


@pytest.mark.parametrize("devices", [(0, 1, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0)])
@pytest.mark.parametrize("one_backend", [False, True], ids=["two backends", "one backend twice"])
async def test_a_graph_over_two_devices_gives_the_numbers_of_one(
    executing_backend: accy.Backend, devices: tuple[int, int, int], one_backend: bool
) -> None:
    """Two CPU backends stand for two devices here (their copies go through the host); on the
    GPU two CUDA backends of one device copy on the device; one backend may be both."""
    kind = executing_backend.kind
    rng = np.random.default_rng(11)
    async with accy.open_backend(kind) as other:
        backends = [executing_backend, executing_backend if one_backend else other]
        document = spread_document(executing_backend, devices)
        async with accy.open_graph(document, backend=backends, max_lanes=2) as run:
            inputs = [rng.standard_normal(N).astype(np.float32) for _ in range(6)]
            got: dict[int, dict[int, np.ndarray]] = {}

            async def one(index: int) -> None:
                got[index] = await run({1: inputs[index]}, read=[1, 2, 3, 4])

            async with anyio.create_task_group() as tasks:
                for index in range(len(inputs)):
                    tasks.start_soon(one, index)
            for index, x in enumerate(inputs):
                np.testing.assert_array_equal(got[index][1], x)
                np.testing.assert_array_equal(got[index][2], x)
                np.testing.assert_array_equal(got[index][3], x + 1)
                np.testing.assert_array_equal(got[index][4], x + (x + 1))
        assert await live_after_drain(other) == {}
    assert await live_after_drain(executing_backend) == {}


async def test_graphs_over_devices_are_checked(cpu_backend: accy.CpuBackend) -> None:
    backend = cpu_backend
    document = spread_document(backend, (0, 1, 1))
    with pytest.raises(accy.UnsupportedOperation) as raised:
        async with accy.open_graph(document, backend=backend):
            pass
    assert raised.value.path == "$.graph.device_count"  # one backend for two devices
    with pytest.raises(accy.UnsupportedOperation, match="one device graph"):
        async with accy.open_graph(document, backend=[backend, backend], device_graph=True):
            pass
    assert document.graph is not None
    kernels = await accy.load_kernels(backend, document.artifact_plan)
    with pytest.raises(accy.UnsupportedOperation, match="open_graph") as raised:
        await accy.launch_graph(kernels, {}, document.graph)
    assert raised.value.path == "$.device_count"
    await kernels.aclose()
    with pytest.raises(accy.PlanError, match="device 2 does not exist"):
        p.LaunchGraphPlan(nodes=(p.GraphNode(kernel_index=0, device=2),), device_count=2)
    with pytest.raises(accy.PlanError, match="no streams, events or loops"):
        p.LaunchGraphPlan(
            nodes=(p.GraphNode(kernel_index=0, stream=0),), stream_count=1, device_count=2
        )
    assert await live_after_drain(backend) == {}


async def test_a_slot_copied_out_is_not_overwritten_before_the_copy_ran(
    executing_backend: accy.Backend,
) -> None:
    """Device 1 is busy (a slow fill) when it is asked to copy slot 1 from device 0; device 0
    then overwrites slot 1. The copy must see the first value: device 0's overwrite waits for
    device 1's stream (the plan names no dependency: the slots say it all)."""
    backend = executing_backend

    def fill(kernel_id: int, slot: int, value: float, spin_ns: int) -> p.PlannedKernel:
        scalars = (p.U32(N), p.F32(value), p.U64(spin_ns))
        return planned(
            backend, kernel_id, "slow_fill_f32", slot, scalars=scalars, launch_resources=geometry(N)
        )

    plan = p.ArtifactPlan(
        slots=tuple(p.Slot(slot_id=i, byte_size=4 * N, dtype=p.DType.F32) for i in (1, 2, 3)),
        kernels=(
            fill(0, 3, 9.0, 200_000_000),
            fill(1, 1, 1.0, 0),
            elementwise(backend, 2, "copy_f32", 2, (1,), N),
            fill(3, 1, 2.0, 0),
        ),
    )
    graph = p.LaunchGraphPlan(
        nodes=tuple(p.GraphNode(kernel_index=i, device=d) for i, d in enumerate((1, 0, 1, 0))),
        device_count=2,
    )
    document = p.LaunchGraphDocument(artifact_plan=plan, graph=graph)
    async with accy.open_backend(backend.kind) as other:
        async with accy.open_graph(document, backend=[backend, other]) as run:
            out = await run(read=[1, 2, 3])
        np.testing.assert_array_equal(out[2], 1.0)  # copied before the overwrite
        np.testing.assert_array_equal(out[1], 2.0)
        np.testing.assert_array_equal(out[3], 9.0)
        assert await live_after_drain(other) == {}
    assert await live_after_drain(backend) == {}


async def test_cancelled_calls_and_closes_over_devices_leave_nothing(
    cpu_backend: accy.CpuBackend,
) -> None:
    backend = cpu_backend
    slow = slow_document(backend, 300_000_000)
    spread = p.LaunchGraphDocument(
        artifact_plan=slow.artifact_plan,
        graph=p.LaunchGraphPlan(
            nodes=(p.GraphNode(kernel_index=0, device=0), p.GraphNode(kernel_index=1, device=1)),
            device_count=2,
        ),
    )
    async with accy.open_backend("cpu") as other:
        async with accy.open_graph(spread, backend=[backend, other]) as run:
            with anyio.move_on_after(0.05):
                await run()
        # A close cancelled with lanes on both devices, and one with two lanes on one device.
        for document, backends in ((spread, [backend, other]), (slow, [backend])):
            run = accy.open_graph(document, backend=backends, max_lanes=2)
            await run.__aenter__()
            async with anyio.create_task_group() as tasks:  # two calls at once: two lanes
                tasks.start_soon(run)
                tasks.start_soon(run)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await run.aclose()
            assert scope.cancelled_caught
        assert await live_after_drain(other) == {}
    assert await live_after_drain(backend) == {}
