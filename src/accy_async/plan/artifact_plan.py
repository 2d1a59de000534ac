"""The artifact plan of ``loaded.zig``: slots, planned kernels, launch candidates, tuning."""

from __future__ import annotations

from typing import Annotated, Final, Literal, TypeAlias

import msgspec

from ..errors import LaunchArgumentMismatch
from ._base import MAX_LAUNCH_ARGUMENTS, U32, U64, ArgumentCount, Base, ObjectId, plan_error
from .geometry import KernelCallLaunch, LaunchGeometry
from .registry import ArtifactSpec, RegistryEntry
from .scalars import DType, ScalarArgument

__all__ = [
    "NO_TUNING",
    "ArtifactPlan",
    "CandidateMeasurement",
    "ElementCountArgument",
    "KernelOrigin",
    "LaunchCandidate",
    "LaunchResources",
    "LaunchTuning",
    "PlannedKernel",
    "Slot",
]

_MAX_SLOT_BYTES: Final = 2**62
_MAX_CANDIDATES: Final = 1024

ElementCountArgument: TypeAlias = Literal["none", "scalar_u32", "device_buffer_u32"]
"""How a kernel learns its element count: not at all, a leading u32 scalar, or a u32 buffer."""

KernelOrigin: TypeAlias = Literal["planned", "kernel_call"]
"""``planned``: compiled for the plan, launched at a candidate geometry.
``kernel_call``: a registry kernel whose geometry its ``kernel_call_launch`` derives."""


class Slot(Base, frozen=True):
    """A buffer the plan's kernels read or write, by ``slot_id``.

    ``byte_size`` is required for slots that are filled with a pattern.
    """

    slot_id: ObjectId
    byte_size: Annotated[int, msgspec.Meta(ge=0, le=_MAX_SLOT_BYTES)] | None = None
    dtype: DType | None = None


class LaunchCandidate(Base, frozen=True):
    """One geometry a kernel may be launched with; tuning picks among them."""

    geometry: LaunchGeometry


class LaunchResources(Base, frozen=True):
    """A kernel's default geometry and the candidates tuning may choose from."""

    geometry: LaunchGeometry = LaunchGeometry()
    candidates: Annotated[
        tuple[LaunchCandidate, ...], msgspec.Meta(max_length=_MAX_CANDIDATES)
    ] = ()


class CandidateMeasurement(Base, frozen=True):
    """The median time of one candidate of one kernel (the seed's LaunchCandidateMeasurement)."""

    kernel_id: ObjectId
    candidate_index: Annotated[int, msgspec.Meta(ge=0, lt=_MAX_CANDIDATES)]
    median_ns: U64
    sample_count: U32 = 0


class LaunchTuning(Base, frozen=True):
    """Measurements to choose launch candidates from; empty means each kernel's first."""

    measurements: tuple[CandidateMeasurement, ...] = ()

    def selected_candidate_index(self, kernel_id: int) -> int:
        """The candidate with the lowest median for ``kernel_id`` (ties: lowest index), else 0."""
        best: CandidateMeasurement | None = None
        for measurement in self.measurements:
            if measurement.kernel_id != kernel_id:
                continue
            if best is None or (measurement.median_ns, measurement.candidate_index) < (
                best.median_ns,
                best.candidate_index,
            ):
                best = measurement
        return 0 if best is None else best.candidate_index


NO_TUNING: Final = LaunchTuning()


class PlannedKernel(Base, frozen=True):
    """One kernel of an artifact plan and how to bind and launch it.

    The kernel's buffers are, in order: the output slot, each input slot, and
    (``element_count_argument == "device_buffer_u32"``) a u32 count buffer.
    Its scalars are: the element count (``"scalar_u32"``), the runtime scalars
    (given at launch, else ``runtime_scalar_defaults``), then
    ``static_arguments``. ``output_fill_pattern`` fills the output slot before
    each launch; ``scratch_fill_pattern`` fills the last input slot, which the
    kernel may then write.
    """

    kernel_id: ObjectId
    work_item_id: ObjectId
    artifact: ArtifactSpec
    output_slot_id: ObjectId
    input_slot_ids: tuple[ObjectId, ...] = ()
    origin: KernelOrigin = "planned"
    output_fill_pattern: U32 | None = None
    scratch_fill_pattern: U32 | None = None
    element_count_argument: ElementCountArgument = "none"
    element_count_argument_value: U64 = 0
    runtime_scalar_argument_count: ArgumentCount = 0
    runtime_scalar_defaults: tuple[ScalarArgument, ...] = ()
    static_arguments: tuple[ScalarArgument, ...] = ()
    launch_resources: LaunchResources = LaunchResources()
    kernel_call_launch: KernelCallLaunch | None = None

    def __post_init__(self) -> None:
        if self.runtime_scalar_defaults and (
            len(self.runtime_scalar_defaults) != self.runtime_scalar_argument_count
        ):
            raise plan_error(
                f"{len(self.runtime_scalar_defaults)} runtime_scalar_defaults for "
                f"{self.runtime_scalar_argument_count} runtime scalar arguments",
                "runtime_scalar_defaults",
            )
        if self.buffer_count > MAX_LAUNCH_ARGUMENTS:
            raise plan_error(
                f"kernel takes {self.buffer_count} buffers, more than {MAX_LAUNCH_ARGUMENTS}",
                "input_slot_ids",
            )
        if self.scalar_count > MAX_LAUNCH_ARGUMENTS:
            raise plan_error(
                f"kernel takes {self.scalar_count} scalars, more than {MAX_LAUNCH_ARGUMENTS}",
                "static_arguments",
            )
        if self.scratch_fill_pattern is not None and not self.input_slot_ids:
            raise plan_error("a scratch fill needs an input slot to fill", "scratch_fill_pattern")
        if (
            self.element_count_argument == "scalar_u32"
            and self.element_count_argument_value > 2**32 - 1
        ):
            raise plan_error(
                f"element count {self.element_count_argument_value} does not fit a u32",
                "element_count_argument_value",
            )

    @classmethod
    def from_entry(
        cls,
        entry: RegistryEntry,
        kernel_id: int,
        output_slot_id: int,
        input_slot_ids: tuple[int, ...] = (),
        runtime_scalar_defaults: tuple[ScalarArgument, ...] = (),
    ) -> PlannedKernel:
        """A pipeline registry's kernel in an artifact plan, bound to these slots.

        Its artifact and launch rule are the entry's; ``runtime_scalar_defaults``
        give its runtime scalars (as many as the entry takes, or none).
        """
        return cls(
            kernel_id=kernel_id,
            work_item_id=kernel_id,
            artifact=entry.artifact_spec(),
            output_slot_id=output_slot_id,
            input_slot_ids=input_slot_ids,
            runtime_scalar_argument_count=entry.runtime_scalar_argument_count,
            runtime_scalar_defaults=runtime_scalar_defaults,
            kernel_call_launch=entry.launch,
        )

    @property
    def buffer_count(self) -> int:
        """Buffers per launch: output, inputs, and the count buffer if any."""
        return 1 + len(self.input_slot_ids) + (self.element_count_argument == "device_buffer_u32")

    @property
    def scalar_count(self) -> int:
        """Scalars per launch: element count, runtime scalars, static arguments."""
        return (
            (self.element_count_argument == "scalar_u32")
            + self.runtime_scalar_argument_count
            + len(self.static_arguments)
        )

    def candidate_geometry(self, tuning: LaunchTuning) -> LaunchGeometry:
        """The geometry tuning selects, or the default one when there are no candidates.

        Raises :class:`LaunchArgumentMismatch` when a measurement names a
        candidate the kernel does not have.
        """
        candidates = self.launch_resources.candidates
        if not candidates:
            return self.launch_resources.geometry
        index = tuning.selected_candidate_index(self.kernel_id)
        if index >= len(candidates):
            raise LaunchArgumentMismatch(
                f"kernel {self.kernel_id} has {len(candidates)} launch candidates, "
                f"tuning selected candidate {index}"
            )
        return candidates[index].geometry


class ArtifactPlan(Base, frozen=True):
    """The port of the seed's ``BackendArtifactPlan``: slots and the kernels that use them."""

    slots: tuple[Slot, ...] = ()
    kernels: tuple[PlannedKernel, ...] = ()

    def __post_init__(self) -> None:
        slot_ids: set[int] = set()
        for index, slot in enumerate(self.slots):
            if slot.slot_id in slot_ids:
                raise plan_error(f"duplicate slot_id {slot.slot_id}", "slots", index, "slot_id")
            slot_ids.add(slot.slot_id)
        kernel_ids: set[int] = set()
        for index, kernel in enumerate(self.kernels):
            if kernel.kernel_id in kernel_ids:
                raise plan_error(
                    f"duplicate kernel_id {kernel.kernel_id}", "kernels", index, "kernel_id"
                )
            kernel_ids.add(kernel.kernel_id)
            if kernel.output_slot_id not in slot_ids:
                raise plan_error(
                    f"output slot {kernel.output_slot_id} is not a slot of the plan",
                    "kernels",
                    index,
                    "output_slot_id",
                )
            for input_index, slot_id in enumerate(kernel.input_slot_ids):
                if slot_id not in slot_ids:
                    raise plan_error(
                        f"input slot {slot_id} is not a slot of the plan",
                        "kernels",
                        index,
                        "input_slot_ids",
                        input_index,
                    )

    def slot_by_id(self, slot_id: int) -> Slot | None:
        """The slot with ``slot_id``, or ``None``."""
        for slot in self.slots:
            if slot.slot_id == slot_id:
                return slot
        return None
