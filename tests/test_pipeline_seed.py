"""The tests of pipeline.zig, ported onto the recording backend with its exact counts.

``testBinding(1001)`` in the seed is a buffer the caller owns; here it is an
external buffer of the recording backend (not counted as an allocation).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

import accy_async as accy
from accy_async import plan as p
from accy_async.pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    launch_pipeline,
    load_pipeline_artifacts,
)

from .seed_fixtures import SEED_ARGUMENTS as ARGS
from .seed_fixtures import SEED_ENTRIES, SEED_PIPELINE, SEED_REGISTRY, seed_entries, seed_launch
from .seed_fixtures import SEED_FORMAT as PTX


def external(backend: accy.RecordingBackend) -> accy.BufferBinding:
    """The seed's ``testBinding``: 20,000 bytes the caller owns."""
    return backend.external_buffer(20_000).bind("read_write")


def request(backend: accy.RecordingBackend, **changes: object) -> PipelineLaunch:
    """The seed's launch over an external operand and result; ``changes`` replace fields."""
    return seed_launch(
        **({"operands": [external(backend)], "results": [external(backend)]} | changes)
    )


@pytest.fixture
async def state() -> AsyncIterator[accy.RecordingBackend]:
    backend = accy.RecordingBackend(formats=(PTX, p.ArtifactFormat.CPU))
    yield backend
    assert not backend.live_objects(owned_only=True), "a device object was left alive"
    await backend.aclose()


async def test_pipeline_executor_derives_intermediates_scalars_and_geometry_per_stage(
    state: accy.RecordingBackend,
) -> None:
    launch = request(state)
    await launch_pipeline(state, launch)
    assert state.buffer_allocate_count == 2
    assert state.allocated_buffer_byte_sizes == [79 * 4, 79 * 4]
    assert state.launch_count == 3
    assert [launch.grid for launch in state.launches] == [(79, 1, 1), (1, 1, 1), (79, 1, 1)]
    assert [launch.first_scalar_u32 for launch in state.launches] == [5000, 79, 5000]
    last = state.launches[-1]
    assert len(last.buffer_ids) == 2
    assert last.buffer_ids[0] == launch.results[0].handle.id
    assert state.load_count == 3
    assert state.destroy_count == 5
    assert set(state.allocated_buffer_ids) <= set(state.destroyed_ids)


async def test_pipeline_executor_rejects_binding_count_mismatches(
    state: accy.RecordingBackend,
) -> None:
    with pytest.raises(accy.LaunchArgumentMismatch):
        await launch_pipeline(state, request(state, operands=[]))
    with pytest.raises(accy.LaunchArgumentMismatch):
        await launch_pipeline(state, request(state, runtime_scalar_arguments=()))
    assert state.launch_count == 0


async def test_pipeline_executor_rejects_runtime_scalar_bounds_before_allocation(
    state: accy.RecordingBackend,
) -> None:
    bounded = msgspec.structs.replace(
        SEED_PIPELINE, runtime_scalar_bounds=(p.RuntimeScalarBound(argument_index=0, max=5000),)
    )
    too_big = (p.U32(5001),)
    with pytest.raises(accy.LaunchArgumentMismatch):
        await launch_pipeline(
            state, request(state, pipeline=bounded, runtime_scalar_arguments=too_big)
        )
    assert state.buffer_allocate_count == 0
    assert state.launch_count == 0
    with pytest.raises(accy.LaunchArgumentMismatch):
        await allocate_pipeline_intermediates(state, bounded, too_big)
    assert state.buffer_allocate_count == 0


async def test_pipeline_executor_refuses_unresolvable_stages_before_any_launch(
    state: accy.RecordingBackend,
) -> None:
    registry = p.KernelCallRegistry(entries=SEED_ENTRIES[:1])
    with pytest.raises(accy.InvalidArtifact):
        await launch_pipeline(state, request(state, registry=registry))
    assert state.launch_count == 0
    assert state.destroy_count == 0


async def test_pipeline_executor_releases_intermediates_after_partial_allocation_failure() -> None:
    state = accy.RecordingBackend(fail_after={"allocate": 1})
    with pytest.raises(accy.OutOfDeviceMemory):
        await launch_pipeline(state, request(state))
    assert state.buffer_allocate_count == 1
    assert state.destroy_count == 1
    assert state.allocated_buffer_ids[0] in state.destroyed_ids


async def test_pipeline_executor_releases_loaded_artifacts_after_staged_load_failure() -> None:
    state = accy.RecordingBackend(fail_after={"load": 1})
    with pytest.raises(accy.RuntimeUnavailable):
        await launch_pipeline(state, request(state))
    assert state.buffer_allocate_count == 2
    assert state.load_count == 1
    assert state.launch_count == 1
    assert state.destroy_count == 3
    assert state.allocated_buffer_ids[0] in state.destroyed_ids
    assert state.allocated_buffer_ids[1] in state.destroyed_ids


async def test_pipeline_executor_reuses_provided_intermediates_without_allocating(
    state: accy.RecordingBackend,
) -> None:
    provided = await allocate_pipeline_intermediates(state, SEED_PIPELINE, ARGS)
    async with provided:
        assert state.buffer_allocate_count == 2
        await launch_pipeline(state, request(state, intermediates=provided))
        assert state.buffer_allocate_count == 2
        assert state.launch_count == 3
        await launch_pipeline(state, request(state, intermediates=provided))
        assert state.buffer_allocate_count == 2
        assert state.launch_count == 6


async def test_pipeline_executor_rejects_undersized_or_miscounted_provided_intermediates(
    state: accy.RecordingBackend,
) -> None:
    operands, results = [external(state)], [external(state)]
    base = request(state, operands=operands, results=results)
    miscounted = [external(state)]
    with pytest.raises(accy.LaunchArgumentMismatch, match="2 intermediates, 1 were given"):
        await launch_pipeline(state, replace(base, intermediates=miscounted))
    first = external(state)
    undersized = [first, state.external_buffer(20_000).bind(byte_size=4)]
    with pytest.raises(accy.LaunchArgumentMismatch, match="has 4 bytes"):
        await launch_pipeline(state, replace(base, intermediates=undersized))
    with pytest.raises(accy.LaunchArgumentMismatch, match="aliases intermediate 0"):
        await launch_pipeline(state, replace(base, intermediates=[first, first]))
    with pytest.raises(accy.LaunchArgumentMismatch, match="aliases operand 0"):
        await launch_pipeline(state, replace(base, intermediates=[operands[0], first]))
    with pytest.raises(accy.LaunchArgumentMismatch, match="aliases result 0"):
        await launch_pipeline(state, replace(base, intermediates=[first, results[0]]))
    assert state.launch_count == 0


def replace(launch: PipelineLaunch, **changes: object) -> PipelineLaunch:
    return msgspec.structs.replace(launch, **changes)


async def test_pipeline_executor_launches_from_a_loaded_artifact_pool_without_driver_round_trips(
    state: accy.RecordingBackend,
) -> None:
    pool = await load_pipeline_artifacts(state, SEED_PIPELINE, SEED_REGISTRY, PTX)
    async with pool:
        assert state.create_count == 3
        assert state.load_count == 3
        provided = await allocate_pipeline_intermediates(state, SEED_PIPELINE, ARGS)
        async with provided:
            for _ in range(3):
                await launch_pipeline(state, request(state, intermediates=provided, artifacts=pool))
        assert state.create_count == 3
        assert state.load_count == 3
        assert state.launch_count == 9


async def test_pipeline_artifact_pool_deinit_destroys_loaded_artifacts(
    state: accy.RecordingBackend,
) -> None:
    pool = await load_pipeline_artifacts(state, SEED_PIPELINE, SEED_REGISTRY, PTX)
    assert state.load_count == 3
    assert state.destroy_count == 0
    await pool.aclose()
    assert state.destroy_count == 3
    assert state.last_destroyed_id == 3


async def test_pipeline_stage_artifacts_carry_their_entrys_scalar_count(
    state: accy.RecordingBackend,
) -> None:
    async with await load_pipeline_artifacts(state, SEED_PIPELINE, SEED_REGISTRY, PTX) as pool:
        for pool_entry, stage in zip(pool.entries, SEED_PIPELINE.stages, strict=True):
            entry = SEED_REGISTRY.find(stage.target, stage.version, PTX)
            assert entry is not None
            assert pool_entry.artifact.scalar_argument_count == entry.runtime_scalar_argument_count
            assert pool_entry.artifact.buffer_argument_count == (
                entry.argument_count - entry.runtime_scalar_argument_count
            )


async def test_pipeline_artifact_pool_cleans_loaded_artifacts_after_staged_load_failure() -> None:
    state = accy.RecordingBackend(fail_after={"load": 1})
    with pytest.raises(accy.RuntimeUnavailable):
        await load_pipeline_artifacts(state, SEED_PIPELINE, SEED_REGISTRY, PTX)
    assert state.load_count == 1
    assert state.destroy_count == 1
    assert state.last_destroyed_id == 1


async def test_pipeline_executor_rejects_mismatched_artifact_pools_before_any_launch(
    state: accy.RecordingBackend,
) -> None:
    async with await load_pipeline_artifacts(state, SEED_PIPELINE, SEED_REGISTRY, PTX) as pool:
        renamed = msgspec.structs.replace(SEED_PIPELINE, target="accy.kernel.test.other_pipeline")
        with pytest.raises(accy.LaunchArgumentMismatch, match="target"):
            await launch_pipeline(state, request(state, pipeline=renamed, artifacts=pool))
        reversioned = msgspec.structs.replace(SEED_PIPELINE, version=9)
        with pytest.raises(accy.LaunchArgumentMismatch, match="version"):
            await launch_pipeline(state, request(state, pipeline=reversioned, artifacts=pool))
    assert state.launch_count == 0


async def test_pipeline_executor_rejects_artifact_pool_format_mismatches_before_any_launch(
    state: accy.RecordingBackend,
) -> None:
    other_format = p.ArtifactFormat.CPU  # the seed uses .metal_msl
    other_registry = p.KernelCallRegistry(entries=seed_entries(other_format))
    async with await load_pipeline_artifacts(state, SEED_PIPELINE, SEED_REGISTRY, PTX) as pool:
        with pytest.raises(accy.LaunchArgumentMismatch, match="format"):
            await launch_pipeline(
                state, request(state, registry=other_registry, format=other_format, artifacts=pool)
            )
    assert state.buffer_allocate_count == 0
    assert state.launch_count == 0
