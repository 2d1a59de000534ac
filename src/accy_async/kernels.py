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

This module loads, launches, measures and closes. A launch resolved
(:class:`PreparedLaunch`, its bindings, fills, scalars and geometry) is made in
:mod:`accy_async._prepared_launch`; what a launch is given (slot bindings,
element-count buffers, options) lives in :mod:`accy_async._launch_arguments`;
their public names are re-exported here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from ._cache import IdentityCache
from ._graph_cache import GraphCache
from ._graph_schedule import Schedule
from ._launch_arguments import (
    CandidateBenchmarkOptions,
    CandidateSynchronization,
    ElementCountBufferBinding,
    LaunchOptions,
    SlotBinding,
    slot_map,
)
from ._loops import checkpoint
from ._prepared_launch import (
    GraphTemplates,
    LaunchTemplate,
    PreparedLaunch,
    config_of,
    fill,
    template,
)
from .backends import (
    Backend,
    BufferBinding,
    EventHandle,
    LoadedArtifact,
    StreamHandle,
    StreamLike,
)
from .errors import (
    InvalidArtifact,
    LaunchArgumentMismatch,
    UnsupportedOperation,
)
from .plan import (
    MAX_LAUNCH_ARGUMENTS,
    ArtifactPlan,
    CandidateMeasurement,
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
        self._graph_templates: IdentityCache[GraphTemplates] = IdentityCache(64)

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
        options: LaunchOptions = LaunchOptions(),  # noqa: B008 - frozen, shared default
        *,
        artifact_plan: ArtifactPlan | None = None,
    ) -> None:
        """Enqueue kernel ``kernel_index`` bound to ``slot_bindings``.

        ``artifact_plan`` may replace the plan the kernels were loaded from
        (new fill patterns or candidates); its kernel must have the loaded
        kernel's ids, else :class:`InvalidArtifact`. Raises
        :class:`LaunchArgumentMismatch` for scalars that do not fit (checked
        first: what the plan and scalars get wrong is reported before any
        buffer is looked at) and :class:`InvalidBuffer` for a slot with no
        binding.
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
        options: LaunchOptions = LaunchOptions(),  # noqa: B008 - frozen, shared default
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
            config_of(geometry.grid, geometry.block, geometry.shared_memory_bytes),
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

        :meth:`launch_template` then its ``bind`` (``pack`` has the backend pack
        the arguments for trusted launches); :meth:`launch_kernel` prepares and
        enqueues. A launch graph keeps each distinct launch's template
        (:meth:`graph_templates`) and binds only the slots per run.
        """
        return self.launch_template(
            kernel_index,
            tuning=tuning,
            runtime_scalar_arguments=runtime_scalar_arguments,
            artifact_plan=artifact_plan,
        ).bind(slots, element_count_buffer, pack=pack)

    def launch_template(
        self,
        kernel_index: int,
        *,
        tuning: LaunchTuning = NO_TUNING,
        runtime_scalar_arguments: Sequence[ScalarArgument] = (),
        artifact_plan: ArtifactPlan | None = None,
    ) -> LaunchTemplate:
        """What :meth:`prepare_launch` resolves besides the bindings, checked.

        See :class:`~accy_async._prepared_launch.LaunchTemplate`.
        """
        planned = self._planned(kernel_index, artifact_plan)
        plan = artifact_plan or self.artifact_plan
        return template(
            planned,
            plan,
            self._slots if plan is self.artifact_plan else None,
            self.loaded[kernel_index],
            self._launchers[kernel_index],
            tuning=tuning,
            runtime_scalar_arguments=runtime_scalar_arguments,
        )

    def graph_templates(self, schedule: Schedule) -> GraphTemplates:
        """The template of each distinct launch of ``schedule`` (its variants), made once.

        Kept for the most recent launch graphs run through these kernels.
        """
        templates = self._graph_templates.get((schedule,))
        if templates is None:
            templates = self._graph_templates.put(
                (schedule,),
                GraphTemplates(
                    [
                        self.launch_template(
                            kernel_index,
                            tuning=node.tuning,
                            runtime_scalar_arguments=node.runtime_scalar_arguments,
                        )
                        for kernel_index, node in schedule.variants
                    ]
                ),
            )
        return templates

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
                fill(backend, binding, pattern, byte_size, stream)
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
        options: CandidateBenchmarkOptions = CandidateBenchmarkOptions(),  # noqa: B008 - frozen
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
