"""One launch of a loaded kernel, resolved: :class:`PreparedLaunch` and what makes it.

:func:`template` works out all of a launch but its buffers, once: the slot
each buffer argument binds (output, inputs, element-count buffer) and its
access, the fills of the output (and a scratch input) with the plan's pattern,
the element count, the runtime scalars (given or the plan's defaults) and the
static arguments checked against the artifact, and the geometry from the
kernel's derived launch rule or its tuned candidate. The
:class:`LaunchTemplate` it returns binds each call's slots
(:meth:`LaunchTemplate.bind`) into a :class:`PreparedLaunch`; a launch graph
keeps one per distinct launch. :func:`fill` runs one planned fill.
:meth:`~accy_async.kernels.LoadedKernels.prepare_launch` makes and binds one;
:mod:`accy_async.kernels` re-exports :class:`PreparedLaunch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
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

__all__ = [
    "GraphTemplates",
    "LaunchTemplate",
    "PreparedLaunch",
    "check_slot",
    "config_of",
    "fill",
    "template",
]

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


class LaunchTemplate:
    """A launch of a planned kernel resolved as far as it goes without buffers.

    Made (and checked) once by :func:`template`: which slot each buffer argument
    binds and with which access, the fills, the scalars and the geometry. Each
    call binds it to its slots with :meth:`bind` (or :meth:`buffers`), which
    only looks the slots up: a launch graph's runs resolve nothing else again.
    """

    __slots__ = (
        "buffer_slots",
        "config",
        "diagnostic_id",
        "fills",
        "kernel_id",
        "launcher",
        "loaded",
        "reads_count_buffer",
        "scalars",
    )

    def __init__(
        self,
        kernel_id: int,
        loaded: LoadedArtifact,
        launcher: StageLauncher,
        buffer_slots: tuple[tuple[int, Access], ...],
        reads_count_buffer: bool,
        fills: tuple[tuple[int, int, int], ...],
        scalars: tuple[ScalarArgument, ...],
        config: LaunchConfig,
        diagnostic_id: str | None,
    ) -> None:
        self.kernel_id = kernel_id
        self.loaded = loaded
        self.launcher = launcher
        self.buffer_slots = buffer_slots
        """``(slot id, access)`` of each buffer argument, in order (the count buffer after)."""
        self.reads_count_buffer = reads_count_buffer
        """Whether the kernel's last buffer is its element-count buffer."""
        self.fills = fills
        """``(buffer position, pattern, slot byte size)`` to fill before each launch."""
        self.scalars = scalars
        self.config = config
        self.diagnostic_id = diagnostic_id

    def buffers(
        self, slots: Mapping[int, BufferBinding], element_count_buffer: BufferBinding | None
    ) -> tuple[BufferBinding, ...]:
        """The buffer arguments bound to ``slots``.

        Raises :class:`InvalidBuffer` for a slot with no binding and
        :class:`LaunchArgumentMismatch` for a missing element-count buffer.
        """
        try:
            bound = [slots[slot_id].with_access(access) for slot_id, access in self.buffer_slots]
        except (KeyError, AttributeError):
            raise _unbound(slots, [slot_id for slot_id, _ in self.buffer_slots]) from None
        if self.reads_count_buffer:
            if element_count_buffer is None:
                raise LaunchArgumentMismatch(
                    f"kernel {self.kernel_id} reads its element count from a buffer, "
                    "and none was given"
                )
            bound.append(element_count_buffer.with_access("read_only"))
        return tuple(bound)

    def bind(
        self,
        slots: Mapping[int, BufferBinding],
        element_count_buffer: BufferBinding | None,
        *,
        pack: bool,
    ) -> PreparedLaunch:
        """The launch bound to ``slots``; its arguments packed by the launcher when ``pack``."""
        return self.with_buffers(self.buffers(slots, element_count_buffer), pack=pack)

    def with_buffers(self, buffers: tuple[BufferBinding, ...], *, pack: bool) -> PreparedLaunch:
        """The launch with ``buffers`` (from :meth:`buffers`) as its buffer arguments."""
        scalars = self.scalars
        return PreparedLaunch(
            loaded=self.loaded,
            buffers=buffers,
            scalars=scalars,
            config=self.config,
            fills=tuple([(buffers[at], pattern, size) for at, pattern, size in self.fills]),
            diagnostic_id=self.diagnostic_id,
            launcher=self.launcher,
            arguments=self.launcher.prepare(buffers, scalars) if pack else None,
        )


class GraphTemplates:
    """The templates of a launch graph's distinct launches, and the checks of their bindings.

    Each run checks every slot it binds once (however many launches bind it);
    the kernels are checked again only once the backend destroyed something
    (:attr:`~accy_async.backends.Backend.removals`).
    """

    __slots__ = (
        "_loaded_checked_at",
        "_pickers",
        "_views",
        "count_ids",
        "count_readers",
        "fills",
        "loaded",
        "slot_ids",
        "templates",
    )

    def __init__(self, templates: Sequence[LaunchTemplate]) -> None:
        self.templates = tuple(templates)
        self.slot_ids = tuple(
            dict.fromkeys(slot_id for each in templates for slot_id, _ in each.buffer_slots)
        )
        """Every slot the launches bind, once each."""
        self.count_ids = tuple(
            dict.fromkeys(each.kernel_id for each in templates if each.reads_count_buffer)
        )
        """The kernels whose element-count buffer a launch binds."""
        self.count_readers = tuple(
            index for index, each in enumerate(templates) if each.reads_count_buffer
        )
        """The launches that bind an element-count buffer (bound by their template)."""
        self.loaded = tuple({id(each.loaded): each.loaded for each in templates}.values())
        self.fills = any(each.fills for each in templates)
        """Whether a launch fills a buffer first (such a graph runs node by node)."""
        self._loaded_checked_at = -1
        self._views = tuple(dict.fromkeys(key for each in templates for key in each.buffer_slots))
        """Every ``(slot id, access)`` a launch binds, once each."""
        self._pickers = [_picker(each.buffer_slots) for each in templates]
        """Per launch, its buffers taken from the run's views by ``(slot id, access)``."""

    def bind(
        self,
        backend: Backend,
        slots: Mapping[int, BufferBinding],
        counts: Mapping[int, BufferBinding],
    ) -> list[tuple[BufferBinding, ...]]:
        """Each launch's buffers, bound to ``slots`` and ``counts`` (by kernel id).

        Raises :class:`InvalidBuffer` for a slot with no binding or a binding
        that is not a live buffer of ``backend`` (the message names the slot),
        :class:`LaunchArgumentMismatch` for a missing element-count buffer,
        :class:`InvalidArtifact` for a kernel no longer loaded.
        """
        try:  # each slot's view for each access once, then each launch's buffers picked out
            views = {key: slots[key[0]].with_access(key[1]) for key in self._views}
        except (KeyError, AttributeError):
            raise _unbound(slots, self.slot_ids) from None
        buffers = [pick(views) for pick in self._pickers]
        for index in self.count_readers:
            reader = self.templates[index]
            buffers[index] = reader.buffers(slots, counts.get(reader.kernel_id))
        removals = backend.removals
        if removals != self._loaded_checked_at:  # none destroyed since: all still loaded
            for loaded in self.loaded:
                if not backend.owns(loaded):
                    raise InvalidArtifact(f"{loaded!r} is not loaded on this backend")
            self._loaded_checked_at = removals
        bound = [slots[slot_id] for slot_id in self.slot_ids]
        bound += [counts[kernel_id] for kernel_id in self.count_ids]
        try:  # each slot once, however many launches bind it
            backend.check_bindings(bound)
        except InvalidBuffer:
            for slot_id in self.slot_ids:  # raises, naming the slot
                check_slot(backend, slots[slot_id], f"slot {slot_id}")
            for kid in self.count_ids:
                name = f"the element-count buffer of kernel {kid}"
                check_slot(backend, counts[kid], name, "$.element_counts")
            raise
        return buffers


def check_slot(
    backend: Backend, binding: BufferBinding, name: str, path: str = "$.slot_bindings"
) -> None:
    """Raise :class:`InvalidBuffer` unless ``binding`` is a live buffer of ``backend``.

    The error's message starts with ``name`` (``slot 3``) and its path is ``path``.
    """
    try:
        backend.check_bindings((binding,))
    except InvalidBuffer as exc:
        raise InvalidBuffer(f"{name}: {exc.message}", path=path) from None


def _unbound(slots: Mapping[int, Any], slot_ids: Sequence[int]) -> InvalidBuffer:
    """The error for the first of ``slot_ids`` with no binding (or not a binding) in ``slots``."""
    for slot_id in slot_ids:
        binding = slots.get(slot_id)
        if binding is None:
            return InvalidBuffer(f"slot {slot_id} has no buffer bound")
        if not isinstance(binding, BufferBinding):
            return InvalidBuffer(
                f"slot {slot_id} is bound to a {type(binding).__name__}, not a BufferBinding"
            )
    return InvalidBuffer("a slot has no buffer bound")


def _picker(
    keys: tuple[tuple[int, Access], ...],
) -> Callable[[Mapping[tuple[int, Access], BufferBinding]], tuple[BufferBinding, ...]]:
    """What takes the bindings of ``keys``, in order, from a run's views (a tuple always)."""
    if len(keys) >= 2:
        return itemgetter(*keys)
    if keys:
        (key,) = keys
        return lambda views: (views[key],)
    return lambda views: ()


def template(
    planned: PlannedKernel,
    plan: ArtifactPlan,
    plan_slots: Mapping[int, Slot] | None,
    loaded: LoadedArtifact,
    launcher: StageLauncher,
    *,
    tuning: LaunchTuning,
    runtime_scalar_arguments: Sequence[ScalarArgument],
) -> LaunchTemplate:
    """Check and resolve what a launch of ``planned`` needs besides its buffers.

    Raises what a bad plan or bad scalars raise (:class:`InvalidArtifact`,
    :class:`UnsupportedOperation` for an unfillable slot,
    :class:`LaunchArgumentMismatch`), before any buffer is looked at.
    """
    buffer_slots: list[tuple[int, Access]] = [(planned.output_slot_id, _output_access(planned))]
    fills: list[tuple[int, int, int]] = []
    if planned.output_fill_pattern is not None:
        size = _fill_size(plan, plan_slots, planned.output_slot_id)
        fills.append((0, planned.output_fill_pattern, size))
    last_input = len(planned.input_slot_ids) - 1
    for input_index, slot_id in enumerate(planned.input_slot_ids):
        scratch = planned.scratch_fill_pattern is not None and input_index == last_input
        buffer_slots.append((slot_id, "read_write" if scratch else "read_only"))
        if scratch:
            assert planned.scratch_fill_pattern is not None
            size = _fill_size(plan, plan_slots, slot_id)
            fills.append((len(buffer_slots) - 1, planned.scratch_fill_pattern, size))
    reads_count_buffer = planned.element_count_argument == "device_buffer_u32"
    buffer_count = len(buffer_slots) + reads_count_buffer
    runtime = _runtime_scalars(planned, runtime_scalar_arguments)
    scalars: list[ScalarArgument] = []
    if planned.element_count_argument == "scalar_u32":
        scalars.append(U32(planned.element_count_argument_value))
    scalars.extend(runtime)
    scalars.extend(planned.static_arguments)
    if buffer_count > MAX_LAUNCH_ARGUMENTS or len(scalars) > MAX_LAUNCH_ARGUMENTS:
        raise LaunchArgumentMismatch(
            f"kernel {planned.kernel_id} would take {buffer_count} buffers and "
            f"{len(scalars)} scalars; the limit is {MAX_LAUNCH_ARGUMENTS} each"
        )
    artifact = loaded.artifact
    if (buffer_count, len(scalars)) != (
        artifact.buffer_argument_count,
        artifact.scalar_argument_count,
    ):
        raise LaunchArgumentMismatch(
            f"kernel {planned.kernel_id} binds {buffer_count} buffers and {len(scalars)} "
            f"scalars, but its artifact {artifact.spec.kernel_name} takes "
            f"{artifact.buffer_argument_count} and {artifact.scalar_argument_count}"
        )
    launch_rule = planned.kernel_call_launch
    if isinstance(launch_rule, DerivedLaunch):
        config = config_of(*launch_rule.resolve(runtime))
    else:
        geometry = planned.candidate_geometry(tuning)
        config = config_of(geometry.grid, geometry.block, geometry.shared_memory_bytes)
    return LaunchTemplate(
        planned.kernel_id,
        loaded,
        launcher,
        tuple(buffer_slots),
        reads_count_buffer,
        tuple(fills),
        tuple(scalars),
        config,
        planned.artifact.diagnostic_id,
    )


def _fill_size(plan: ArtifactPlan, plan_slots: Mapping[int, Slot] | None, slot_id: int) -> int:
    """The byte size of slot ``slot_id`` for a 32-bit fill pattern (checked)."""
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
    return byte_size


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
