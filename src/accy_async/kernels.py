"""Loaded kernels: the port of ``loaded.zig``.

:func:`load_kernels` creates and loads every kernel of an artifact plan;
:class:`LoadedKernels` launches them with slot bindings. A launch is a
non-blocking enqueue: it binds the kernel's output slot, its input slots and
its element-count buffer; fills the output (and a scratch input) with the
plan's pattern first; passes the element count, the runtime scalars (given or
the plan's defaults) and the static arguments; and picks the geometry from the
kernel's derived launch rule or its tuned candidate.

Dataflow graphs over loaded kernels are launched by
:func:`accy_async.graph.launch_graph`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

from ._graph_cache import GraphCache
from ._loops import checkpoint
from .backends import (
    Access,
    Backend,
    BufferBinding,
    EventHandle,
    LaunchConfig,
    LoadedArtifact,
    StageLauncher,
    StreamHandle,
    StreamLike,
)
from .errors import (
    InvalidArtifact,
    InvalidBuffer,
    LaunchArgumentMismatch,
    UnsupportedOperation,
)
from .plan import (
    MAX_LAUNCH_ARGUMENTS,
    U32,
    ArtifactPlan,
    CandidateMeasurement,
    DerivedLaunch,
    LaunchTuning,
    PlannedKernel,
    ScalarArgument,
    Slot,
    validate_plan,
)
from .plan.artifact_plan import NO_TUNING
from .waiting import release_when_idle, synchronize

__all__ = [
    "CandidateBenchmarkOptions",
    "CandidateSynchronization",
    "ElementCountBufferBinding",
    "LaunchOptions",
    "LoadedKernels",
    "PreparedLaunch",
    "SlotBinding",
    "load_kernels",
    "slot_map",
]

_MAX_FALLBACK_FILL_BYTES: Final = 4096
"""Largest slot filled by writing the pattern when the backend cannot fill (the seed's 4096)."""

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
    """How :meth:`LoadedKernels.measure_launch_candidates` times each candidate.

    ``synchronize`` says what each sample waits for: nothing (enqueue time),
    the whole device, ``base_options.stream``, or ``base_options.signal_event``.
    """

    warmup: int = 1
    samples: int = 5
    synchronize: CandidateSynchronization = "stream"
    base_options: LaunchOptions = field(default_factory=LaunchOptions)


@functools.lru_cache(maxsize=1024)
def _config_of(
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


async def load_kernels(backend: Backend, artifact_plan: ArtifactPlan) -> LoadedKernels:
    """Create and load every kernel of ``artifact_plan`` on ``backend``.

    A failure part way unloads the kernels already loaded and raises the error.
    Use the result as an async context manager, or close it with ``aclose``.
    """
    await checkpoint()
    validate_plan(artifact_plan)
    loaded: list[LoadedArtifact] = []
    try:
        for planned in artifact_plan.kernels:
            artifact = await backend.create_artifact(planned.artifact)
            loaded.append(await backend.load_artifact(artifact))
    except BaseException:
        backend.destroy_all(reversed(loaded))
        raise
    return LoadedKernels(backend, artifact_plan, loaded)


class LoadedKernels:
    """The loaded kernels of one artifact plan, launchable with slot bindings.

    Launch methods are synchronous, non-blocking enqueues. The object tracks
    the streams it launched on, so :meth:`aclose` can wait for them before it
    unloads the kernels.
    """

    def __init__(
        self, backend: Backend, artifact_plan: ArtifactPlan, loaded: Sequence[LoadedArtifact]
    ) -> None:
        if len(loaded) != len(artifact_plan.kernels):
            raise InvalidArtifact(
                f"{len(loaded)} loaded kernels for a plan of {len(artifact_plan.kernels)}"
            )
        self.backend = backend
        self.artifact_plan = artifact_plan
        self.loaded: tuple[LoadedArtifact, ...] = tuple(loaded)
        self.kernel_ids: tuple[int, ...] = tuple(k.kernel_id for k in artifact_plan.kernels)
        self._streams_used: set[StreamLike | None] = set()
        self._closed = False
        self._slots: dict[int, Slot] = {slot.slot_id: slot for slot in artifact_plan.slots}
        self._launchers = tuple(backend.stage_launcher(each) for each in self.loaded)
        self.device_graphs = GraphCache(backend)
        """Launch graphs run through these kernels as one device graph, by schedule."""
        self._launched_before: OrderedDict[int, object] = OrderedDict()

    def launched_before(self, key: object) -> bool:
        """Whether ``key`` (a launch graph's schedule) was launched through these kernels.

        Remembers it for next time (the most recent 64 keys).
        """
        seen = self._launched_before
        if seen.get(id(key)) is key:
            seen.move_to_end(id(key))
            return True
        seen[id(key)] = key
        if len(seen) > 64:
            seen.popitem(last=False)
        return False

    def track_stream(self, stream: StreamLike | None) -> None:
        """Note that work of these kernels was enqueued on ``stream`` (closing waits for it)."""
        self._streams_used.add(stream)

    @property
    def streams_used(self) -> list[StreamHandle | None]:
        """The streams work of these kernels was enqueued on (live or not)."""
        return [s for s in self._streams_used if s is None or type(s) is StreamHandle]

    @property
    def kernel_count(self) -> int:
        """How many kernels are loaded."""
        return len(self.loaded)

    # ----- one launch ----------------------------------------------------------------------

    def launch_kernel(
        self,
        kernel_index: int,
        slot_bindings: Sequence[SlotBinding] | Mapping[int, BufferBinding],
        element_count_buffer: BufferBinding | None = None,
        options: LaunchOptions = LaunchOptions(),
        *,
        artifact_plan: ArtifactPlan | None = None,
    ) -> None:
        """Enqueue kernel ``kernel_index`` bound to ``slot_bindings``.

        ``artifact_plan`` may replace the plan the kernels were loaded from
        (new fill patterns or candidates); its kernel must have the loaded
        kernel's ids, else :class:`InvalidArtifact`. Raises
        :class:`InvalidBuffer` for a slot with no binding and
        :class:`LaunchArgumentMismatch` for scalars that do not fit.
        """
        slots = slot_bindings if isinstance(slot_bindings, Mapping) else slot_map(slot_bindings)
        prepared = self.prepare_launch(
            kernel_index,
            slots,
            element_count_buffer,
            tuning=options.tuning,
            runtime_scalar_arguments=options.runtime_scalar_arguments,
            artifact_plan=artifact_plan,
        )
        self.enqueue(prepared, options.stream, options.wait_events, options.signal_event)

    def launch_kernel_with_arguments(
        self,
        kernel_index: int,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        options: LaunchOptions = LaunchOptions(),
        *,
        artifact_plan: ArtifactPlan | None = None,
    ) -> None:
        """Enqueue a planned kernel with explicit buffers and scalars at its tuned geometry.

        Only ``planned``-origin kernels can be launched this way
        (:class:`UnsupportedOperation` otherwise); the geometry is the tuned
        candidate's, or the default when the kernel has no candidates.
        """
        planned = self._planned(kernel_index, artifact_plan)
        if planned.origin != "planned":
            raise UnsupportedOperation(
                f"kernel {planned.kernel_id} is a {planned.origin!r} kernel; only planned "
                "kernels take explicit arguments"
            )
        if len(buffers) > MAX_LAUNCH_ARGUMENTS or len(scalars) > MAX_LAUNCH_ARGUMENTS:
            raise LaunchArgumentMismatch(
                f"{len(buffers)} buffers and {len(scalars)} scalars exceed the limit of "
                f"{MAX_LAUNCH_ARGUMENTS} each"
            )
        geometry = planned.candidate_geometry(options.tuning)
        self._streams_used.add(options.stream)
        self.backend.launch(
            self.loaded[kernel_index],
            buffers,
            scalars,
            _config_of(geometry.grid, geometry.block, geometry.shared_memory_bytes),
            stream=options.stream,
            wait_events=options.wait_events,
            signal_event=options.signal_event,
            diagnostic_id=planned.artifact.diagnostic_id,
        )

    def prepare_launch(
        self,
        kernel_index: int,
        slots: Mapping[int, BufferBinding],
        element_count_buffer: BufferBinding | None = None,
        *,
        tuning: LaunchTuning = NO_TUNING,
        runtime_scalar_arguments: Sequence[ScalarArgument] = (),
        artifact_plan: ArtifactPlan | None = None,
        pack: bool = False,
    ) -> PreparedLaunch:
        """Resolve bindings, fills, scalars and geometry of one launch, without enqueuing.

        The graph runner prepares each distinct launch once (with ``pack``, so
        the backend packs its arguments for trusted launches) and enqueues it
        many times; :meth:`launch_kernel` prepares and enqueues.
        """
        planned = self._planned(kernel_index, artifact_plan)
        plan = artifact_plan or self.artifact_plan
        buffers: list[BufferBinding] = []
        fills: list[tuple[BufferBinding, int, int]] = []
        output = _binding_for_slot(slots, planned.output_slot_id, _output_access(planned))
        if planned.output_fill_pattern is not None:
            fills.append(
                self._fill_plan(plan, planned.output_slot_id, output, planned.output_fill_pattern)
            )
        buffers.append(output)
        last_input = len(planned.input_slot_ids) - 1
        for input_index, slot_id in enumerate(planned.input_slot_ids):
            scratch = planned.scratch_fill_pattern is not None and input_index == last_input
            binding = _binding_for_slot(slots, slot_id, "read_write" if scratch else "read_only")
            if scratch:
                assert planned.scratch_fill_pattern is not None
                fills.append(self._fill_plan(plan, slot_id, binding, planned.scratch_fill_pattern))
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
        artifact = self.loaded[kernel_index].artifact
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
            config = _config_of(*launch_rule.resolve(runtime))
        else:
            geometry = planned.candidate_geometry(tuning)
            config = _config_of(geometry.grid, geometry.block, geometry.shared_memory_bytes)
        launcher = self._launchers[kernel_index]
        return PreparedLaunch(
            loaded=self.loaded[kernel_index],
            buffers=tuple(buffers),
            scalars=tuple(scalars),
            config=config,
            fills=tuple(fills),
            diagnostic_id=planned.artifact.diagnostic_id,
            launcher=launcher,
            arguments=launcher.prepare(buffers, scalars) if pack else None,
        )

    def enqueue(
        self,
        prepared: PreparedLaunch,
        stream: StreamLike | None = None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
        *,
        trusted: bool = False,
    ) -> None:
        """Enqueue a prepared launch: its fills, then the kernel, in stream order.

        ``trusted`` skips the backend's per-launch checks, for callers that
        have checked (with :meth:`check_live`) that the prepared launch's
        buffers and the events and stream given are live, and prepared it
        with ``pack``.
        """
        backend = self.backend
        if stream is not None and type(stream) is not StreamHandle:
            stream = backend.adopt_stream(stream)
        if prepared.fills:
            for binding, pattern, byte_size in prepared.fills:
                _fill(backend, binding, pattern, byte_size, stream)
        self._streams_used.add(stream)
        if trusted and prepared.arguments is not None:
            prepared.launcher.launch_prepared(
                prepared.arguments,
                prepared.config,
                stream,
                wait_events,
                signal_event,
            )
            return
        backend.launch(
            prepared.loaded,
            prepared.buffers,
            prepared.scalars,
            prepared.config,
            stream=stream,
            wait_events=wait_events,
            signal_event=signal_event,
            diagnostic_id=prepared.diagnostic_id,
        )

    def repack(self, prepared: PreparedLaunch) -> PreparedLaunch:
        """``prepared`` with its arguments packed for trusted enqueues (as ``pack=True`` does)."""
        return dataclasses.replace(
            prepared, arguments=prepared.launcher.prepare(prepared.buffers, prepared.scalars)
        )

    def check_live(self, prepared: PreparedLaunch) -> None:
        """Raise :class:`InvalidBuffer` unless every buffer of ``prepared`` is live here."""
        if not self.backend.owns(prepared.loaded):
            raise InvalidArtifact(f"{prepared.loaded!r} is not loaded on this backend")
        self.backend.check_bindings(prepared.buffers, "$.buffers")

    # ----- measurement ---------------------------------------------------------------------

    async def measure_launch_candidates(
        self,
        kernel_index: int,
        slot_bindings: Sequence[SlotBinding] | Mapping[int, BufferBinding],
        element_count_buffer: BufferBinding | None = None,
        options: CandidateBenchmarkOptions = CandidateBenchmarkOptions(),
    ) -> list[CandidateMeasurement]:
        """Time every launch candidate of one kernel; one measurement per candidate.

        Each candidate runs ``warmup`` times, then ``samples`` times, each
        launch followed by the chosen synchronization (awaited, never
        blocking); the median of the samples is reported. Raises
        :class:`LaunchArgumentMismatch` for zero samples, a kernel without
        candidates, or a synchronization whose stream or event is missing.
        """
        await checkpoint()
        if options.samples <= 0:
            raise LaunchArgumentMismatch("measuring needs at least one sample")
        if options.warmup < 0:
            raise LaunchArgumentMismatch("warmup cannot be negative")
        planned = self._planned(kernel_index, None)
        candidates = planned.launch_resources.candidates
        if not candidates:
            raise LaunchArgumentMismatch(f"kernel {planned.kernel_id} has no launch candidates")
        base = options.base_options
        if options.synchronize == "stream" and base.stream is None:
            raise LaunchArgumentMismatch("stream synchronization needs base_options.stream")
        if options.synchronize == "event" and base.signal_event is None:
            raise LaunchArgumentMismatch("event synchronization needs base_options.signal_event")
        slots = slot_bindings if isinstance(slot_bindings, Mapping) else slot_map(slot_bindings)
        measurements = []
        for candidate_index in range(len(candidates)):
            forced = LaunchTuning(
                measurements=(
                    CandidateMeasurement(
                        kernel_id=planned.kernel_id, candidate_index=candidate_index, median_ns=0
                    ),
                )
            )
            prepared = self.prepare_launch(
                kernel_index,
                slots,
                element_count_buffer,
                tuning=forced,
                runtime_scalar_arguments=base.runtime_scalar_arguments,
            )
            for _ in range(options.warmup):
                self.enqueue(prepared, base.stream, base.wait_events, base.signal_event)
                await self._synchronize_measured(base, options.synchronize)
            samples = []
            for _ in range(options.samples):
                start = time.perf_counter_ns()
                self.enqueue(prepared, base.stream, base.wait_events, base.signal_event)
                await self._synchronize_measured(base, options.synchronize)
                samples.append(time.perf_counter_ns() - start)
            samples.sort()
            measurements.append(
                CandidateMeasurement(
                    kernel_id=planned.kernel_id,
                    candidate_index=candidate_index,
                    median_ns=samples[len(samples) // 2],
                    sample_count=options.samples,
                )
            )
        return measurements

    async def _synchronize_measured(
        self, options: LaunchOptions, synchronization: CandidateSynchronization
    ) -> None:
        if synchronization == "device":
            await synchronize(self.backend)
        elif synchronization == "stream":
            await synchronize(self.backend, stream=options.stream)
        elif synchronization == "event":
            await synchronize(self.backend, event=options.signal_event)

    # ----- closing -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Wait for the work launched through these kernels, then unload them.

        The wait is shielded from cancellation and bounded; if it cannot finish,
        the kernels are released later, once the device is done with them.
        """
        if self._closed:
            await checkpoint()
            return
        self._closed = True
        streams = list(self._streams_used)
        await release_when_idle(
            self.backend, [*self.device_graphs.take_all(), *self.loaded], streams
        )

    async def __aenter__(self) -> LoadedKernels:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ----- helpers -------------------------------------------------------------------------

    def _planned(self, kernel_index: int, artifact_plan: ArtifactPlan | None) -> PlannedKernel:
        plan = artifact_plan or self.artifact_plan
        if not 0 <= kernel_index < min(len(self.loaded), len(plan.kernels)):
            raise InvalidArtifact(
                f"kernel index {kernel_index} is out of range ({len(self.loaded)} loaded)"
            )
        planned = plan.kernels[kernel_index]
        if artifact_plan is not None and artifact_plan is not self.artifact_plan:
            loaded_plan = self.artifact_plan.kernels[kernel_index]
            if (planned.kernel_id, planned.work_item_id) != (
                loaded_plan.kernel_id,
                loaded_plan.work_item_id,
            ):
                raise InvalidArtifact(
                    f"kernel {kernel_index} of the given plan is kernel {planned.kernel_id} "
                    f"(work item {planned.work_item_id}), but kernel {loaded_plan.kernel_id} "
                    f"(work item {loaded_plan.work_item_id}) is loaded there"
                )
        return planned

    def _fill_plan(
        self, plan: ArtifactPlan, slot_id: int, binding: BufferBinding, pattern: int
    ) -> tuple[BufferBinding, int, int]:
        slot = self._slots.get(slot_id) if plan is self.artifact_plan else plan.slot_by_id(slot_id)
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


def slot_map(slot_bindings: Sequence[SlotBinding]) -> dict[int, BufferBinding]:
    """``slot_id -> binding``; the first binding of a slot wins, as in the seed's lookup."""
    slots: dict[int, BufferBinding] = {}
    for slot_binding in slot_bindings:
        slots.setdefault(slot_binding.slot_id, slot_binding.binding)
    return slots


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


def _fill(
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
