"""Every behaviour of loaded.zig, on the recording backend (exact counts) and the CPU (numbers)."""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
import pytest

import accy_async as accy
from accy_async import plan as p
from accy_async.kernels import (
    CandidateBenchmarkOptions,
    LaunchOptions,
    SlotBinding,
    load_kernels,
)

from .plans import (
    artifact_plan,
    bind_all,
    candidates,
    destroy_bindings,
    elementwise,
    fill_by_buffer_count,
    fill_by_scalar_count,
    geometry,
    planned,
)

N = 256


COPY_SIZES = {1: 4 * N, 2: 4 * N}


def copy_plan(backend: accy.Backend) -> p.ArtifactPlan:
    """Kernel 7 copies slot 1 into 2, ``N`` floats each."""
    return artifact_plan(COPY_SIZES, elementwise(backend, 7, "copy_f32", 2, (1,), N))


def with_kernel_changed(plan: p.ArtifactPlan, **changes: object) -> p.ArtifactPlan:
    """``plan`` with ``changes`` made to its one kernel."""
    (kernel,) = plan.kernels
    return p.ArtifactPlan(slots=plan.slots, kernels=(msgspec.structs.replace(kernel, **changes),))


# ----- loading -------------------------------------------------------------------------------


async def test_load_kernels_creates_and_loads_each_kernel(recording: accy.RecordingBackend) -> None:
    plan = artifact_plan(
        {1: 16, 2: 16}, *(planned(recording, i, "copy_f32", 2, (1,)) for i in range(3))
    )
    async with await load_kernels(recording, plan) as kernels:
        assert kernels.kernel_count == 3
        assert (recording.create_count, recording.load_count) == (3, 3)
    assert recording.destroy_count == 3
    assert recording.destroyed_ids == recording.loaded_ids


async def test_a_failed_load_unloads_what_was_loaded() -> None:
    backend = accy.RecordingBackend(fail_after={"load": 2})
    plan = artifact_plan(
        {1: 16, 2: 16}, *(planned(backend, i, "copy_f32", 2, (1,)) for i in range(4))
    )
    with pytest.raises(accy.RuntimeUnavailable):
        await load_kernels(backend, plan)
    assert backend.load_count == 2
    assert backend.destroy_count == 2
    assert backend.last_destroyed_id == backend.loaded_ids[0]  # unloaded in reverse
    assert not [k for k in backend.live_objects().values() if k != "stream"]
    await backend.aclose()


# ----- binding -------------------------------------------------------------------------------


async def test_slots_bind_output_inputs_and_count_buffer_with_their_access(
    recording: accy.RecordingBackend,
) -> None:
    sizes = {1: 64, 2: 64, 3: 64}
    plan = artifact_plan(
        sizes,
        planned(recording, 1, "add_f32", 3, (1, 2), scalars=(p.U32(4),)),
        planned(recording, 2, "add_f32", 3, (3, 1), scalars=(p.U32(4),)),
        fill_by_buffer_count(recording, 3, 1, 9),
    )
    bindings = bind_all(recording, sizes)
    count = recording.allocate_buffer(4)
    async with await load_kernels(recording, plan) as kernels:
        kernels.launch_kernel(0, bindings)
        kernels.launch_kernel(1, bindings)
        kernels.launch_kernel(2, bindings, count.bind())
        with pytest.raises(accy.LaunchArgumentMismatch, match="none was given"):
            kernels.launch_kernel(2, bindings)
        with pytest.raises(accy.InvalidBuffer, match="slot 3 has no buffer"):
            kernels.launch_kernel(0, bindings[:1])
    first, second, third = recording.launches
    ids = {b.slot_id: b.binding.handle.id for b in bindings}
    assert first.buffer_ids == (ids[3], ids[1], ids[2])
    assert first.buffer_access == ("write_only", "read_only", "read_only")
    assert second.buffer_access == ("read_write", "read_only", "read_only")  # output is also read
    assert third.buffer_ids == (ids[1], count.id)
    assert third.buffer_access == ("write_only", "read_only")
    assert third.scalars == (p.U32(9),)
    destroy_bindings(recording, bindings)
    recording.destroy(count)


async def test_fill_patterns_fill_the_output_and_the_scratch_input(
    recording: accy.RecordingBackend,
) -> None:
    sizes = {1: 64, 2: 64, 3: 64}
    plan = artifact_plan(
        sizes,
        planned(
            recording,
            1,
            "add_f32",
            3,
            (1, 2),
            scalars=(p.U32(4),),
            output_fill_pattern=0xAAAAAAAA,
            scratch_fill_pattern=0x55,
        ),
    )
    bindings = bind_all(recording, sizes)
    ids = {b.slot_id: b.binding.handle.id for b in bindings}
    async with await load_kernels(recording, plan) as kernels:
        kernels.launch_kernel(0, bindings)
    assert recording.fills == [(ids[3], 0xAAAAAAAA), (ids[2], 0x55)]
    assert recording.launches[0].buffer_access == ("write_only", "read_only", "read_write")
    destroy_bindings(recording, bindings)


async def test_fill_falls_back_to_a_write_of_at_most_4096_bytes() -> None:
    backend = accy.RecordingBackend()
    backend.inject_fault("fill", repeat=True)  # the backend cannot fill

    def filled_copy(output_size: int | None, pattern: int) -> p.ArtifactPlan:
        """Four floats copied from slot 1 into slot 2, which is filled with ``pattern`` first."""
        return artifact_plan(
            {1: 16, 2: output_size},
            planned(
                backend, 1, "copy_f32", 2, (1,), scalars=(p.U32(4),), output_fill_pattern=pattern
            ),
        )

    small = filled_copy(16, 0x01020304)
    bindings = bind_all(backend, {1: 16, 2: 16})
    async with await load_kernels(backend, small) as kernels:
        kernels.launch_kernel(0, bindings)
    assert backend.writes == [(bindings[1].binding.handle.id, 0, bytes([4, 3, 2, 1]) * 4)]
    for size, error in (
        (4100, accy.UnsupportedOperation),
        (None, accy.UnsupportedOperation),
        (6, accy.InvalidArtifact),
        (0, accy.InvalidArtifact),
    ):
        async with await load_kernels(backend, filled_copy(size, 7)) as kernels:
            with pytest.raises(error):
                kernels.launch_kernel(0, bindings)
    assert backend.launch_count == 1
    destroy_bindings(backend, bindings)
    await backend.aclose()


async def test_element_count_argument_modes(recording: accy.RecordingBackend) -> None:
    plan = artifact_plan(
        {1: 64},
        planned(recording, 1, "block_probe", 1),
        fill_by_scalar_count(recording, 2, 1, 5, 12),
        fill_by_buffer_count(recording, 3, 1, 5),
    )
    bindings = bind_all(recording, {1: 64})
    count = recording.allocate_buffer(4)
    async with await load_kernels(recording, plan) as kernels:
        kernels.launch_kernel(0, bindings)
        kernels.launch_kernel(1, bindings)
        kernels.launch_kernel(2, bindings, count.bind())
    none, scalar, device = recording.launches
    assert (none.scalars, len(none.buffer_ids)) == ((), 1)
    assert scalar.scalars == (p.U32(12), p.U32(5))
    assert device.scalars == (p.U32(5),)
    assert device.buffer_ids[-1] == count.id
    destroy_bindings(recording, bindings)
    recording.destroy(count)


async def test_runtime_scalars_given_replace_the_defaults(recording: accy.RecordingBackend) -> None:
    plan = artifact_plan(
        {1: 64},
        planned(recording, 1, "iota_f32", 1, scalars=(p.U32(3), p.F32(1.5))),
        planned(recording, 2, "iota_f32", 1, runtime_scalar_argument_count=2),
    )
    bindings = bind_all(recording, {1: 64})
    async with await load_kernels(recording, plan) as kernels:
        kernels.launch_kernel(0, bindings)
        kernels.launch_kernel(
            0, bindings, options=LaunchOptions(runtime_scalar_arguments=(p.U32(8), p.F32(0.0)))
        )
        with pytest.raises(accy.LaunchArgumentMismatch, match="takes 2 runtime scalar"):
            kernels.launch_kernel(
                0, bindings, options=LaunchOptions(runtime_scalar_arguments=(p.U32(8),))
            )
        with pytest.raises(accy.LaunchArgumentMismatch, match="no defaults"):
            kernels.launch_kernel(1, bindings)
    assert [launch.scalars for launch in recording.launches] == [
        (p.U32(3), p.F32(1.5)),
        (p.U32(8), p.F32(0.0)),
    ]
    destroy_bindings(recording, bindings)


async def test_geometry_comes_from_the_derived_launch_or_the_tuned_candidate(
    recording: accy.RecordingBackend,
) -> None:
    derived = p.DerivedLaunch(
        grid=(p.CeilDiv(argument_index=0, divisor=64), p.Fixed(1), p.Fixed(1)), block=(64, 1, 1)
    )
    plan = artifact_plan(
        {1: 64},
        planned(
            recording,
            1,
            "block_probe",
            1,
            launch_resources=candidates(64, 128, 256, grids=(16, 8, 4)),
        ),
        planned(
            recording,
            2,
            "iota_f32",
            1,
            origin="kernel_call",
            scalars=(p.U32(1000), p.F32(0)),
            kernel_call_launch=derived,
        ),
        planned(
            recording,
            3,
            "block_probe",
            1,
            launch_resources=p.LaunchResources(
                geometry=p.LaunchGeometry(grid=(3, 1, 1), block=(32, 1, 1))
            ),
        ),
    )
    bindings = bind_all(recording, {1: 64})
    tuned = p.LaunchTuning(
        measurements=(
            p.CandidateMeasurement(kernel_id=1, candidate_index=0, median_ns=900),
            p.CandidateMeasurement(kernel_id=1, candidate_index=2, median_ns=300),
            p.CandidateMeasurement(kernel_id=1, candidate_index=1, median_ns=300),
            p.CandidateMeasurement(kernel_id=99, candidate_index=0, median_ns=1),
        )
    )
    async with await load_kernels(recording, plan) as kernels:
        kernels.launch_kernel(0, bindings)  # untuned: the first candidate
        kernels.launch_kernel(0, bindings, options=LaunchOptions(tuning=tuned))  # tie -> index 1
        kernels.launch_kernel(1, bindings)
        kernels.launch_kernel(2, bindings)  # no candidates: the default geometry
        bad = p.LaunchTuning(
            measurements=(p.CandidateMeasurement(kernel_id=1, candidate_index=5, median_ns=1),)
        )
        with pytest.raises(accy.LaunchArgumentMismatch, match="selected candidate 5"):
            kernels.launch_kernel(0, bindings, options=LaunchOptions(tuning=bad))
    assert [(launch.grid, launch.block) for launch in recording.launches] == [
        ((16, 1, 1), (64, 1, 1)),
        ((8, 1, 1), (128, 1, 1)),
        ((16, 1, 1), (64, 1, 1)),
        ((3, 1, 1), (32, 1, 1)),
    ]
    destroy_bindings(recording, bindings)


async def test_kernel_index_and_plan_mismatches_are_invalid_artifacts(
    recording: accy.RecordingBackend,
) -> None:
    plan = copy_plan(recording)
    other = with_kernel_changed(plan, kernel_id=8)
    bindings = bind_all(recording, COPY_SIZES)
    async with await load_kernels(recording, plan) as kernels:
        with pytest.raises(accy.InvalidArtifact, match="out of range"):
            kernels.launch_kernel(1, bindings)
        with pytest.raises(accy.InvalidArtifact, match="is loaded there"):
            kernels.launch_kernel(0, bindings, artifact_plan=other)
        same = with_kernel_changed(plan, output_fill_pattern=1)
        kernels.launch_kernel(0, bindings, artifact_plan=same)
    assert recording.fill_count == 1
    assert recording.launch_count == 1
    destroy_bindings(recording, bindings)


async def test_launch_with_arguments_takes_planned_kernels_only(
    recording: accy.RecordingBackend,
) -> None:
    plan = artifact_plan(
        {1: 64, 2: 64},
        planned(recording, 1, "copy_f32", 2, (1,), launch_resources=geometry(16)),
        planned(recording, 2, "copy_f32", 2, (1,), origin="kernel_call"),
    )
    a, b = recording.allocate_buffer(64), recording.allocate_buffer(64)
    async with await load_kernels(recording, plan) as kernels:
        kernels.launch_kernel_with_arguments(0, [a.bind(), b.bind()], [p.U32(16)])
        with pytest.raises(accy.UnsupportedOperation, match="only planned kernels"):
            kernels.launch_kernel_with_arguments(1, [a.bind(), b.bind()], [p.U32(16)])
        with pytest.raises(accy.LaunchArgumentMismatch, match="exceed the limit of 32"):
            kernels.launch_kernel_with_arguments(0, [a.bind()] * 33, [p.U32(16)])
    (launch,) = recording.launches
    assert launch.grid == (1, 1, 1) and launch.buffer_ids == (a.id, b.id)
    recording.destroy(a)
    recording.destroy(b)


# ----- measuring candidates ------------------------------------------------------------------


async def test_measure_launch_candidates_counts_and_checks(
    recording: accy.RecordingBackend,
) -> None:
    plan = artifact_plan(
        {1: 64},
        planned(recording, 5, "block_probe", 1, launch_resources=candidates(32, 64, 128)),
        planned(recording, 6, "block_probe", 1),
    )
    bindings = bind_all(recording, {1: 64})
    stream = recording.create_stream()
    async with await load_kernels(recording, plan) as kernels:
        measured = await kernels.measure_launch_candidates(
            0,
            bindings,
            options=CandidateBenchmarkOptions(
                warmup=2, samples=3, base_options=LaunchOptions(stream=stream)
            ),
        )
        assert [(m.kernel_id, m.candidate_index, m.sample_count) for m in measured] == [
            (5, 0, 3),
            (5, 1, 3),
            (5, 2, 3),
        ]
        assert recording.launch_count == 3 * (2 + 3)
        assert [launch.block[0] for launch in recording.launches[:5]] == [32] * 5
        for options, message in (
            (CandidateBenchmarkOptions(samples=0), "at least one sample"),
            (CandidateBenchmarkOptions(synchronize="stream"), "needs base_options.stream"),
            (CandidateBenchmarkOptions(synchronize="event"), "needs base_options.signal_event"),
        ):
            with pytest.raises(accy.LaunchArgumentMismatch, match=message):
                await kernels.measure_launch_candidates(0, bindings, options=options)
        with pytest.raises(accy.LaunchArgumentMismatch, match="no launch candidates"):
            await kernels.measure_launch_candidates(1, bindings)
        with pytest.raises(accy.InvalidArtifact):
            await kernels.measure_launch_candidates(4, bindings)
        syncs: tuple[Literal["none", "device"], ...] = ("none", "device")
        for sync in syncs:
            await kernels.measure_launch_candidates(
                0,
                bindings,
                options=CandidateBenchmarkOptions(warmup=0, samples=1, synchronize=sync),
            )
    destroy_bindings(recording, bindings)
    recording.destroy(stream)


async def test_candidates_are_chosen_from_real_measurements(cpu_backend: accy.CpuBackend) -> None:
    backend = cpu_backend
    plan = artifact_plan(
        {1: 64},
        planned(backend, 5, "block_probe", 1, launch_resources=candidates(256, 64, 512, 128)),
    )
    bindings = bind_all(backend, {1: 64})
    stream = backend.create_stream()
    async with await load_kernels(backend, plan) as kernels:
        measured = await kernels.measure_launch_candidates(
            0,
            bindings,
            options=CandidateBenchmarkOptions(
                warmup=1, samples=5, base_options=LaunchOptions(stream=stream)
            ),
        )
        tuning = p.LaunchTuning(measurements=tuple(measured))
        assert tuning.selected_candidate_index(5) == 1
        kernels.launch_kernel(0, bindings, options=LaunchOptions(stream=stream, tuning=tuning))
        got = await accy.wait_read(backend.enqueue_read(bindings[0].binding.handle, stream=stream))
        assert np.frombuffer(got, np.uint32)[0] == 64
    destroy_bindings(backend, bindings)
    backend.destroy(stream)


# ----- real numbers on the CPU and CUDA ---------------------------------------------------


async def test_fills_and_count_modes_produce_the_right_bytes(
    executing_backend: accy.Backend,
) -> None:
    backend = executing_backend
    sizes = {1: 64, 2: 64}
    plan = artifact_plan(
        sizes,
        fill_by_scalar_count(
            backend, 1, 1, 3, 5, output_fill_pattern=0xEEEEEEEE, launch_resources=geometry(16)
        ),
        fill_by_buffer_count(
            backend, 2, 2, 4, output_fill_pattern=0x11111111, launch_resources=geometry(16)
        ),
    )
    bindings = bind_all(backend, sizes)
    count = backend.allocate_buffer(4)
    backend.write_buffer(count, np.array([7], np.uint32).tobytes())
    async with await load_kernels(backend, plan) as kernels:
        kernels.launch_kernel(0, bindings)
        kernels.launch_kernel(1, bindings, count.bind())
        first = np.frombuffer(
            await accy.wait_read(backend.enqueue_read(bindings[0].binding.handle)), np.uint32
        )
        second = np.frombuffer(
            await accy.wait_read(backend.enqueue_read(bindings[1].binding.handle)), np.uint32
        )
    assert first.tolist() == [3] * 5 + [0xEEEEEEEE] * 11
    assert second.tolist() == [4] * 7 + [0x11111111] * 9
    destroy_bindings(backend, bindings)
    backend.destroy(count)


async def test_slot_bindings_can_be_a_mapping(executing_backend: accy.Backend) -> None:
    backend = executing_backend
    plan = copy_plan(backend)
    src, dst = backend.allocate_buffer(4 * N), backend.allocate_buffer(4 * N)
    backend.write_buffer(src, np.arange(N, dtype=np.float32).tobytes())
    async with await load_kernels(backend, plan) as kernels:
        kernels.launch_kernel(0, {1: src.bind(), 2: dst.bind()})
        got = np.frombuffer(await accy.wait_read(backend.enqueue_read(dst)), np.float32)
    np.testing.assert_array_equal(got, np.arange(N, dtype=np.float32))
    backend.destroy(src)
    backend.destroy(dst)
    assert SlotBinding(1, src.bind()).slot_id == 1
