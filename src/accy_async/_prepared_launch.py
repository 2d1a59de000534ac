"""One launch of a loaded kernel, resolved: :class:`PreparedLaunch` and what makes it.

:func:`prepare` binds the kernel's output slot, its input slots and its
element-count buffer, plans the fills of the output (and a scratch input) with
the plan's pattern, puts together the element count, the runtime scalars
(given or the plan's defaults) and the static arguments, checks them against
the artifact, and picks the geometry from the kernel's derived launch rule or
its tuned candidate. :func:`fill` runs one planned fill.
:meth:`~accy_async.kernels.LoadedKernels.prepare_launch` calls :func:`prepare`;
:mod:`accy_async.kernels` re-exports :class:`PreparedLaunch`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .backends import (
    Access,
    Backend,
    BufferBinding,
    LaunchConfig,
    LoadedArtifact,
    StageLauncher,
    StreamLike,
)
from .errors import InvalidArtifact, InvalidBuffer, LaunchArgumentMismatch, UnsupportedOperation
from .plan import (
    MAX_LAUNCH_ARGUMENTS,
    U32,
    ArtifactPlan,
    DerivedLaunch,
    LaunchTuning,
    PlannedKernel,
    ScalarArgument,
    Slot,
)

__all__ = ["PreparedLaunch", "config_of", "fill", "prepare"]

_MAX_FALLBACK_FILL_BYTES: Final = 4096
"""Largest slot filled by writing the pattern when the backend cannot fill (the seed's 4096)."""


@functools.lru_cache(maxsize=1024)
def config_of(
    grid: tuple[int, int, int], block: tuple[int, int, int], shared_memory_bytes: int
) -> LaunchConfig:
    """The :class:`LaunchConfig` of a geometry, made (and checked) once per geometry."""
    return LaunchConfig(grid, block, shared_memory_bytes)


@dataclass(frozen=True, slots=True)
class PreparedLaunch:
    """Everything a launch of one kernel needs, resolved: ready for ``backend.launch``."""

    loaded: LoadedArtifact
    buffers: tuple[BufferBinding, ...]
    scalars: tuple[ScalarArgument, ...]
    config: LaunchConfig
    """Its grid, block and shared memory."""
    fills: tuple[tuple[BufferBinding, int, int], ...]
    """``(binding, pattern, slot byte size)`` to fill before each launch."""
    diagnostic_id: str | None
    launcher: StageLauncher
    """The backend's bound launcher of ``loaded``, for trusted (pre-checked) launches."""
    arguments: Any
    """``buffers`` and ``scalars`` as ``launcher.prepare`` packed them (``pack=True``)."""


def prepare(
    planned: PlannedKernel,
    plan: ArtifactPlan,
    plan_slots: Mapping[int, Slot] | None,
    loaded: LoadedArtifact,
    launcher: StageLauncher,
    slots: Mapping[int, BufferBinding],
    element_count_buffer: BufferBinding | None,
    *,
    tuning: LaunchTuning,
    runtime_scalar_arguments: Sequence[ScalarArgument],
    pack: bool,
) -> PreparedLaunch:
    """Resolve bindings, fills, scalars and geometry of one launch of ``planned``.

    ``plan`` is the plan ``planned`` comes from; ``plan_slots`` its slots by id,
    when the caller has them at hand (else they are looked up in ``plan``);
    ``loaded`` the loaded kernel and ``launcher`` its bound launcher, which packs
    the arguments when ``pack``.
    """
    buffers: list[BufferBinding] = []
    fills: list[tuple[BufferBinding, int, int]] = []
    output = _binding_for_slot(slots, planned.output_slot_id, _output_access(planned))
    if planned.output_fill_pattern is not None:
        fills.append(
            _fill_plan(
                plan, plan_slots, planned.output_slot_id, output, planned.output_fill_pattern
            )
        )
    buffers.append(output)
    last_input = len(planned.input_slot_ids) - 1
    for input_index, slot_id in enumerate(planned.input_slot_ids):
        scratch = planned.scratch_fill_pattern is not None and input_index == last_input
        binding = _binding_for_slot(slots, slot_id, "read_write" if scratch else "read_only")
        if scratch:
            assert planned.scratch_fill_pattern is not None
            fills.append(
                _fill_plan(plan, plan_slots, slot_id, binding, planned.scratch_fill_pattern)
            )
        buffers.append(binding)
    if planned.element_count_argument == "device_buffer_u32":
        if element_count_buffer is None:
            raise LaunchArgumentMismatch(
                f"kernel {planned.kernel_id} reads its element count from a buffer, "
                "and none was given"
            )
        buffers.append(element_count_buffer.with_access("read_only"))

    runtime = _runtime_scalars(planned, runtime_scalar_arguments)
    scalars: list[ScalarArgument] = []
    if planned.element_count_argument == "scalar_u32":
        scalars.append(U32(planned.element_count_argument_value))
    scalars.extend(runtime)
    scalars.extend(planned.static_arguments)
    if len(buffers) > MAX_LAUNCH_ARGUMENTS or len(scalars) > MAX_LAUNCH_ARGUMENTS:
        raise LaunchArgumentMismatch(
            f"kernel {planned.kernel_id} would take {len(buffers)} buffers and "
            f"{len(scalars)} scalars; the limit is {MAX_LAUNCH_ARGUMENTS} each"
        )
    artifact = loaded.artifact
    if (len(buffers), len(scalars)) != (
        artifact.buffer_argument_count,
        artifact.scalar_argument_count,
    ):
        raise LaunchArgumentMismatch(
            f"kernel {planned.kernel_id} binds {len(buffers)} buffers and {len(scalars)} "
            f"scalars, but its artifact {artifact.spec.kernel_name} takes "
            f"{artifact.buffer_argument_count} and {artifact.scalar_argument_count}"
        )
    launch_rule = planned.kernel_call_launch
    if isinstance(launch_rule, DerivedLaunch):
        config = config_of(*launch_rule.resolve(runtime))
    else:
        geometry = planned.candidate_geometry(tuning)
        config = config_of(geometry.grid, geometry.block, geometry.shared_memory_bytes)
    return PreparedLaunch(
        loaded=loaded,
        buffers=tuple(buffers),
        scalars=tuple(scalars),
        config=config,
        fills=tuple(fills),
        diagnostic_id=planned.artifact.diagnostic_id,
        launcher=launcher,
        arguments=launcher.prepare(buffers, scalars) if pack else None,
    )


def _fill_plan(
    plan: ArtifactPlan,
    plan_slots: Mapping[int, Slot] | None,
    slot_id: int,
    binding: BufferBinding,
    pattern: int,
) -> tuple[BufferBinding, int, int]:
    slot = plan_slots.get(slot_id) if plan_slots is not None else plan.slot_by_id(slot_id)
    if slot is None:
        raise InvalidArtifact(f"slot {slot_id} is not a slot of the plan")
    byte_size = slot.byte_size
    if byte_size is None:
        raise UnsupportedOperation(f"slot {slot_id} has no byte_size, so it cannot be filled")
    if byte_size == 0 or byte_size % 4:
        raise InvalidArtifact(
            f"slot {slot_id} of {byte_size} bytes cannot take a 32-bit fill pattern"
        )
    return binding, pattern, byte_size


def _binding_for_slot(
    slots: Mapping[int, BufferBinding], slot_id: int, access: Access
) -> BufferBinding:
    binding = slots.get(slot_id)
    if binding is None:
        raise InvalidBuffer(f"slot {slot_id} has no buffer bound")
    return binding.with_access(access)


def _output_access(planned: PlannedKernel) -> Access:
    return "read_write" if planned.output_slot_id in planned.input_slot_ids else "write_only"


def _runtime_scalars(
    planned: PlannedKernel, given: Sequence[ScalarArgument]
) -> Sequence[ScalarArgument]:
    count = planned.runtime_scalar_argument_count
    if count == 0:
        return ()
    arguments = given if given else planned.runtime_scalar_defaults
    if len(arguments) != count:
        raise LaunchArgumentMismatch(
            f"kernel {planned.kernel_id} takes {count} runtime scalar arguments, "
            f"got {len(arguments)}"
            + (" and the plan has no defaults" if not given and not arguments else "")
        )
    return arguments


def fill(
    backend: Backend,
    binding: BufferBinding,
    pattern: int,
    byte_size: int,
    stream: StreamLike | None,
) -> None:
    """The seed's fill: the backend's fill, else write the pattern for small slots."""
    try:
        backend.fill_buffer(binding.handle, pattern, stream=stream)
    except UnsupportedOperation:
        if byte_size > _MAX_FALLBACK_FILL_BYTES:
            raise
        backend.write_buffer(
            binding.handle,
            pattern.to_bytes(4, "little") * (byte_size // 4),
            offset=binding.offset,
            stream=stream,
        )
