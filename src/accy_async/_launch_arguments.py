"""What a launch of loaded kernels is given: slot bindings, element-count buffers, options.

:class:`SlotBinding` and :class:`ElementCountBufferBinding` bind buffers to a
plan's slots and kernels (:func:`slot_map` makes the lookup a launch uses);
:class:`LaunchOptions` says where and how one launch runs, and
:class:`CandidateBenchmarkOptions` how measuring times each candidate.
:mod:`accy_async.kernels` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from .backends import BufferBinding, EventHandle, StreamLike
from .plan import LaunchTuning, ScalarArgument
from .plan.artifact_plan import NO_TUNING

__all__ = [
    "CandidateBenchmarkOptions",
    "CandidateSynchronization",
    "ElementCountBufferBinding",
    "LaunchOptions",
    "SlotBinding",
    "slot_map",
]

CandidateSynchronization: TypeAlias = Literal["none", "device", "stream", "event"]


@dataclass(frozen=True, slots=True)
class SlotBinding:
    """The buffer bound to one slot of the artifact plan."""

    slot_id: int
    binding: BufferBinding


@dataclass(frozen=True, slots=True)
class ElementCountBufferBinding:
    """The u32 element-count buffer of one kernel (``device_buffer_u32`` kernels)."""

    kernel_id: int
    binding: BufferBinding


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """Where and how one launch runs (the seed's ``LaunchOptions``).

    ``runtime_scalar_arguments``, when not empty, replace the plan's defaults.
    """

    stream: StreamLike | None = None
    """A :class:`StreamHandle`, another library's stream, or ``None`` (the default stream)."""
    wait_events: Sequence[EventHandle] = ()
    signal_event: EventHandle | None = None
    tuning: LaunchTuning = NO_TUNING
    runtime_scalar_arguments: Sequence[ScalarArgument] = ()


@dataclass(frozen=True, slots=True)
class CandidateBenchmarkOptions:
    """How :meth:`~accy_async.kernels.LoadedKernels.measure_launch_candidates` times each candidate.

    ``synchronize`` says what each sample waits for: nothing (enqueue time),
    the whole device, ``base_options.stream``, or ``base_options.signal_event``.
    """

    warmup: int = 1
    samples: int = 5
    synchronize: CandidateSynchronization = "stream"
    base_options: LaunchOptions = field(default_factory=LaunchOptions)


def slot_map(slot_bindings: Sequence[SlotBinding]) -> dict[int, BufferBinding]:
    """``slot_id -> binding``; the first binding of a slot wins, as in the seed's lookup."""
    return {each.slot_id: each.binding for each in reversed(slot_bindings)}
