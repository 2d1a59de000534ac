"""Kernel pipelines: the port of ``pipeline.zig``.

``await launch_pipeline(backend, request)`` runs a chain of registry kernels
once. Everything is checked before anything is allocated or launched: the
chain against the registry, the operand and result counts, the runtime
scalars and their bounds, a pool's stage count, version, format and target,
each scratch buffer's count, size and that it aliases no other scratch,
operand or result buffer, and, for a request made from a plan document
(:meth:`PipelineLaunch.of`), each operand's and result's size and dtype. The
stages then launch in order on ``request.stream``.

Ownership follows the seed. With neither a pool nor scratch buffers, the call
allocates the intermediates and loads the kernels itself, waits for the
stream (without blocking the loop) and destroys them. With both, it returns
as soon as the stages are enqueued; the caller awaits the stream before
reusing or freeing the buffers. After an error or a cancellation, the call
waits (shielded, bounded) for what it enqueued and destroys every object it
owns, even when that wait fails.

To launch one chain many times, load a :class:`PipelineArtifactPool` and
allocate :class:`PipelineIntermediates` once::

    pool = await load_pipeline_artifacts(backend, pipeline, registry, fmt)
    scratch = await allocate_pipeline_intermediates(backend, pipeline, scalars)
    async with pool, scratch:
        await launch_pipeline(backend, PipelineLaunch(..., artifacts=pool, intermediates=scratch))
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

from ._cache import IdentityCache
from ._loops import admit, checkpoint
from .backends import (
    Backend,
    BufferBinding,
    BufferHandle,
    KernelArtifact,
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
    LimitExceeded,
    UnsupportedOperation,
)
from .plan import (
    ArtifactFormat,
    Constant,
    Forward,
    Intermediate,
    KernelCallPipeline,
    KernelCallRegistry,
    Operand,
    PipelineBuffer,
    PipelineDocument,
    PipelineIntermediate,
    RegistryEntry,
    ScalarArgument,
    ScalarDerivation,
    resolve_quantity,
    validate_plan,
)
from .plan.scalars import SCALAR_CLASSES, integer_value
from .waiting import release_when_idle, wait_stream

__all__ = [
    "PipelineArtifactPool",
    "PipelineIntermediates",
    "PipelineLaunch",
    "PoolEntry",
    "Resolution",
    "allocate_pipeline_intermediates",
    "choose_format",
    "enqueue_checked",
    "intermediate_byte_size",
    "launch_pipeline",
    "load_pipeline_artifacts",
    "resolve_launch",
]

_MAX_BYTES: Final = 2**63 - 1


@dataclass(frozen=True, slots=True)
class PoolEntry:
    """One stage of a pool: its created artifact and the loaded kernel."""

    artifact: KernelArtifact
    loaded: LoadedArtifact


class PipelineArtifactPool:
    """The created and loaded kernels of one pipeline, one per stage.

    Labelled with the chain's ``target``, ``version`` and ``format``, so a
    launch can check it was loaded for that chain. Many tasks may launch the
    same pool at once, on different streams. Closing it (``aclose`` or leaving
    ``async with``) waits for the streams it was launched on, then destroys
    every loaded kernel; the created artifacts are host memory and go with it.
    """

    def __init__(
        self,
        backend: Backend,
        pipeline: KernelCallPipeline,
        registry: KernelCallRegistry,
        format: ArtifactFormat,
        entries: Sequence[PoolEntry],
    ) -> None:
        self.backend = backend
        self.pipeline = pipeline
        self.registry = registry
        self.target = pipeline.target
        self.version = pipeline.version
        self.format = format
        self.entries: tuple[PoolEntry, ...] = tuple(entries)
        self.launchers: tuple[StageLauncher, ...] = tuple(
            backend.stage_launcher(entry.loaded) for entry in self.entries
        )
        self.streams_used: set[StreamHandle | None] = set()
        self.closed = False
        self._accepted: set[tuple[int, ArtifactFormat]] = set()
        self.memos: OrderedDict[int, _Memo] = OrderedDict()
        """Requests launched more than once, checked and packed for their relaunches."""
        self.seen: OrderedDict[int, PipelineLaunch] = OrderedDict()
        """Requests launched once (by id): a second launch packs them into a memo."""

    def accept(self, backend: Backend, program: _Program, format: ArtifactFormat) -> None:
        """Check that the pool fits a launch of ``program`` in ``format`` on ``backend``.

        Raises :class:`LaunchArgumentMismatch` when it is closed, from another
        backend, or loaded for another stage count, version, format or target.
        """
        if self.closed:
            raise LaunchArgumentMismatch("the artifact pool is closed", path="$.artifacts")
        if self.backend is not backend:
            raise LaunchArgumentMismatch(
                "the artifact pool was loaded on another backend", path="$.artifacts"
            )
        key = (id(program), format)
        if key in self._accepted:
            return
        pipeline = program.pipeline
        for what, have, want in (
            ("stages", len(self.entries), len(pipeline.stages)),
            ("version", self.version, pipeline.version),
            ("format", self.format, format),
            ("target", self.target, pipeline.target),
        ):
            if have != want:
                raise LaunchArgumentMismatch(
                    f"the artifact pool's {what} is {have!r}, the launch needs {want!r}",
                    path="$.artifacts",
                )
        self._accepted.add(key)

    async def aclose(self) -> None:
        """Wait for the launches that used the pool, then unload every stage."""
        if self.closed:
            await checkpoint()
            return
        self.closed = True
        await release_when_idle(
            self.backend, [entry.loaded for entry in self.entries], list(self.streams_used)
        )

    async def __aenter__(self) -> PipelineArtifactPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class PipelineIntermediates(Sequence[BufferBinding]):
    """The scratch buffers of one pipeline, allocated once for many launches.

    A sequence of read-write bindings, one per intermediate, sized for the
    runtime scalars they were allocated with. Closing waits for the streams
    they were launched on, then frees them.
    """

    def __init__(self, backend: Backend, bindings: Sequence[BufferBinding]) -> None:
        self.backend = backend
        self.bindings: tuple[BufferBinding, ...] = tuple(bindings)
        self.streams_used: set[StreamHandle | None] = set()
        self.closed = False
        self.handle_ids: frozenset[int] = frozenset(id(binding.handle) for binding in bindings)
        """The buffers' identities, for the check that no operand aliases one."""

    @overload
    def __getitem__(self, index: int) -> BufferBinding: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[BufferBinding]: ...
    def __getitem__(self, index: int | slice) -> BufferBinding | Sequence[BufferBinding]:
        return self.bindings[index]

    def __len__(self) -> int:
        return len(self.bindings)

    def __iter__(self) -> Iterator[BufferBinding]:
        return iter(self.bindings)

    async def aclose(self) -> None:
        """Wait for the launches that used the buffers, then free them."""
        if self.closed:
            await checkpoint()
            return
        self.closed = True
        await release_when_idle(
            self.backend, [binding.handle for binding in self.bindings], list(self.streams_used)
        )

    async def __aenter__(self) -> PipelineIntermediates:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@dataclass(frozen=True, slots=True)
class PipelineLaunch:
    """One run of a pipeline (the seed's ``PipelineLaunch``).

    ``intermediates`` and ``artifacts`` are optional: without them the call
    allocates and loads what it needs and waits for completion before freeing
    it. ``stream`` defaults to the backend's default stream.
    """

    pipeline: KernelCallPipeline
    registry: KernelCallRegistry
    format: ArtifactFormat | None = None
    """``None``: the pool's format, or :func:`choose_format`'s without a pool."""
    operands: Sequence[BufferBinding] = ()
    results: Sequence[BufferBinding] = ()
    runtime_scalar_arguments: Sequence[ScalarArgument | int | float] = ()
    intermediates: Sequence[BufferBinding] | None = None
    artifacts: PipelineArtifactPool | None = None
    stream: StreamLike | None = None
    """The stream to run on: a :class:`StreamHandle`, another library's stream
    (``torch.cuda.current_stream()``, a CuPy or cuda.core stream), or ``None`` for the
    backend's default stream."""
    diagnostic_id: str | None = None
    operand_shapes: Sequence[PipelineBuffer] = ()
    """What each operand must hold (a plan document's ``operands``): when given, each
    operand is checked to hold at least its extent, and its dtype where the buffer knows one,
    before anything launches. :meth:`of` fills it from a document."""
    result_shapes: Sequence[PipelineBuffer] = ()
    """The same for the results."""

    @classmethod
    def of(
        cls,
        document: PipelineDocument,
        *,
        operands: Sequence[BufferBinding] = (),
        results: Sequence[BufferBinding] = (),
        runtime_scalar_arguments: Sequence[ScalarArgument | int | float] = (),
        intermediates: Sequence[BufferBinding] | None = None,
        artifacts: PipelineArtifactPool | None = None,
        stream: StreamLike | None = None,
        format: ArtifactFormat | None = None,
        diagnostic_id: str | None = None,
    ) -> PipelineLaunch:
        """A launch of ``document``'s pipeline whose buffers are checked against its shapes.

        An undersized buffer or one of another dtype is refused with a
        :class:`LaunchArgumentMismatch` naming it, before anything launches
        (a kernel would read or write past its end).
        """
        return cls(
            pipeline=document.pipeline,
            registry=document.registry,
            format=format,
            operands=operands,
            results=results,
            runtime_scalar_arguments=runtime_scalar_arguments,
            intermediates=intermediates,
            artifacts=artifacts,
            stream=stream,
            diagnostic_id=diagnostic_id,
            operand_shapes=document.operands,
            result_shapes=document.results,
        )


# ----- the checked form of a (pipeline, registry, format) ----------------------------------


@dataclass(frozen=True, slots=True)
class _Program:
    """A pipeline checked against a registry in one format, with each stage's entry."""

    pipeline: KernelCallPipeline
    registry: KernelCallRegistry
    format: ArtifactFormat
    entries: tuple[RegistryEntry, ...]
    refs: tuple[tuple[tuple[int, int], ...], ...]
    """Per stage, each buffer as ``(source, index)``: 0 operand, 1 result, 2 intermediate."""
    resolved: OrderedDict[tuple[ScalarArgument | int | float, ...], Resolution]


@dataclass(frozen=True, slots=True)
class Resolution:
    """What the runtime scalars decide for one pipeline (see :func:`resolve_launch`).

    Each stage's scalars and geometry, the scratch sizes; cached per pipeline.
    """

    arguments: tuple[ScalarArgument, ...]
    """The runtime scalars, typed."""
    stage_scalars: tuple[tuple[ScalarArgument, ...], ...]
    configs: tuple[LaunchConfig, ...]
    """Each stage's launch geometry."""
    intermediate_sizes: tuple[int, ...]
    refs: tuple[tuple[tuple[int, int], ...], ...]
    """Per stage, each buffer as ``(source, index)`` (the pipeline's, kept here for launches)."""


@dataclass(frozen=True, slots=True)
class _Memo:
    """A request checked in full once, with its stages' arguments packed, for relaunching."""

    request: PipelineLaunch
    stream: StreamHandle | None
    """The request's stream, adopted (see :meth:`Backend.adopt_stream`)."""
    sequences: tuple[Sequence[BufferBinding], Sequence[BufferBinding], Sequence[BufferBinding]]
    bindings: tuple[BufferBinding, ...]
    stages: tuple[tuple[StageLauncher, Any, LaunchConfig], ...]
    """Each stage's launcher and packed arguments."""
    immutable: bool
    """Whether the request's sequences are tuples (or intermediates): they cannot change."""

    def still_holds(self, backend: Backend) -> bool:
        """Whether the request's buffers are the ones checked, and all still live."""
        request = self.request
        sequences = self.sequences
        if (
            request.operands is not sequences[0]
            or request.results is not sequences[1]
            or request.intermediates is not sequences[2]
        ):
            return False
        if not self.immutable:
            flat = (*request.operands, *request.results, *(request.intermediates or ()))
            if len(flat) != len(self.bindings) or any(
                a is not b for a, b in zip(flat, self.bindings, strict=True)
            ):
                return False
        backend.check_bindings(self.bindings, "$.buffers")
        stream = self.stream
        return stream is None or backend.owns(stream)


_MEMO_CAPACITY: Final = 64

_programs: IdentityCache[_Program] = IdentityCache(128)
_RESOLVED_CAPACITY: Final = 64


def _program(
    pipeline: KernelCallPipeline, registry: KernelCallRegistry, format: ArtifactFormat
) -> _Program:
    program = _programs.get((pipeline, registry), format)
    if program is not None:
        return program
    validate_plan(pipeline)
    validate_plan(registry)
    entries = pipeline.validate(registry, format)
    refs = tuple(
        tuple(
            (
                0 if isinstance(ref, Operand) else 2 if isinstance(ref, Intermediate) else 1,
                ref.index,
            )
            for ref in stage.buffers
        )
        for stage in pipeline.stages
    )
    return _programs.put(
        (pipeline, registry),
        _Program(pipeline, registry, format, entries, refs, OrderedDict()),
        format,
    )


def _resolve(program: _Program, arguments: Sequence[ScalarArgument | int | float]) -> Resolution:
    key = tuple(arguments)
    cached = program.resolved.get(key)
    if cached is not None:
        return cached
    pipeline = program.pipeline
    arguments = pipeline.validate_runtime_scalar_arguments(key)
    if arguments != key:
        # Plain numbers: 5, 5.0 and True are equal keys, so they are never stored; the
        # typed arguments they make are.
        key = arguments
        cached = program.resolved.get(key)
        if cached is not None:
            return cached
    sizes = tuple(
        intermediate_byte_size(spec, arguments, index)
        for index, spec in enumerate(pipeline.intermediates)
    )
    stage_scalars = []
    configs = []
    for stage_index, (stage, entry) in enumerate(
        zip(pipeline.stages, program.entries, strict=True)
    ):
        scalars = tuple(_derive(derivation, arguments, stage_index) for derivation in stage.scalars)
        stage_scalars.append(scalars)
        configs.append(LaunchConfig(*entry.launch.resolve(scalars)))
    resolved = Resolution(
        tuple(arguments), tuple(stage_scalars), tuple(configs), sizes, program.refs
    )
    program.resolved[key] = resolved
    if len(program.resolved) > _RESOLVED_CAPACITY:
        program.resolved.popitem(last=False)
    return resolved


def _derive(
    derivation: ScalarDerivation, arguments: Sequence[ScalarArgument], stage_index: int
) -> ScalarArgument:
    if isinstance(derivation, Constant):
        return derivation.value
    argument = arguments[derivation.argument_index]
    if isinstance(derivation, Forward):
        return argument
    value = integer_value(argument)
    if value is None or value < 0:
        raise LaunchArgumentMismatch(
            f"stage {stage_index} divides runtime scalar {derivation.argument_index}, which must "
            f"be a non-negative integer, got {argument!r}",
            path=f"$.runtime_scalar_arguments[{derivation.argument_index}]",
        )
    return SCALAR_CLASSES[argument.type_name](-(-value // derivation.divisor))


# ----- public operations -------------------------------------------------------------------


def choose_format(backend: Backend, plan: PipelineDocument | KernelCallRegistry) -> ArtifactFormat:
    """The first of the backend's preferred formats that the plan's registry provides.

    What :func:`load_pipeline_artifacts` and :func:`launch_pipeline` use when
    given no format. Raises :class:`UnsupportedOperation` when the registry
    has none of them.
    """
    registry = plan.registry if isinstance(plan, PipelineDocument) else plan
    available = registry.formats()
    for candidate in backend.preferred_formats:
        if candidate in available:
            return candidate
    raise UnsupportedOperation(
        f"the plan has no kernels for the {backend.kind} backend "
        f"(it has {sorted(f.value for f in available)})"
    )


def intermediate_byte_size(
    spec: PipelineIntermediate,
    runtime_scalar_arguments: Sequence[ScalarArgument],
    index: int | None = None,
) -> int:
    """Bytes of one intermediate (the pipeline's ``index``-th) for these runtime scalars.

    Raises :class:`InvalidArtifact` when the extent is zero or the size does
    not fit in 63 bits (the seed's overflow check), naming the intermediate.
    """
    path = None if index is None else f"$.pipeline.intermediates[{index}].extent"
    extent = resolve_quantity(spec.extent, runtime_scalar_arguments)
    if extent == 0:
        raise InvalidArtifact("an intermediate resolves to zero elements", path=path)
    byte_size = extent * spec.dtype.size
    if byte_size > _MAX_BYTES:
        raise InvalidArtifact(
            f"an intermediate of {extent} {spec.dtype.value} overflows 63 bits", path=path
        )
    return byte_size


async def load_pipeline_artifacts(
    backend: Backend,
    pipeline: KernelCallPipeline,
    registry: KernelCallRegistry,
    format: ArtifactFormat | None = None,
) -> PipelineArtifactPool:
    """Create and load each stage's registry entry into a new pool.

    ``format`` defaults to :func:`choose_format`'s (the backend's most
    preferred that the registry has). The whole chain is checked against the
    registry first. A failure (or a cancellation) part way unloads the stages
    already loaded.
    """
    await checkpoint()
    if format is None:
        format = choose_format(backend, registry)
    program = _program(pipeline, registry, format)
    entries: list[PoolEntry] = []
    try:
        for entry in program.entries:
            artifact = await backend.create_artifact(entry.artifact_spec())
            entries.append(PoolEntry(artifact, await backend.load_artifact(artifact)))
    except BaseException:
        backend.destroy_all([pool_entry.loaded for pool_entry in entries])
        raise
    return PipelineArtifactPool(backend, pipeline, registry, format, entries)


async def allocate_pipeline_intermediates(
    backend: Backend,
    pipeline: KernelCallPipeline,
    runtime_scalar_arguments: Sequence[ScalarArgument | int | float],
) -> PipelineIntermediates:
    """Allocate each intermediate once, sized for these runtime scalars, 256-byte aligned.

    The runtime scalars and every size (against the backend's limits) are
    checked before the first allocation; a failure part way frees what was
    allocated.
    """
    await checkpoint()
    validate_plan(pipeline)
    arguments = pipeline.validate_runtime_scalar_arguments(runtime_scalar_arguments)
    sizes = [
        intermediate_byte_size(spec, arguments, index)
        for index, spec in enumerate(pipeline.intermediates)
    ]
    return PipelineIntermediates(backend, _allocate(backend, pipeline, sizes))


def _allocate(
    backend: Backend, pipeline: KernelCallPipeline, sizes: Sequence[int]
) -> list[BufferBinding]:
    limits = backend.limits
    for index, size in enumerate(sizes):
        if size > limits.max_buffer_bytes:
            raise LimitExceeded(
                f"intermediate {index} needs {size} bytes, over the limit of "
                f"{limits.max_buffer_bytes} bytes per buffer",
                path=f"$.intermediates[{index}]",
            )
    if sum(sizes) > limits.max_total_bytes:
        raise LimitExceeded(
            f"the intermediates need {sum(sizes)} bytes together, over the backend's limit of "
            f"{limits.max_total_bytes}"
        )
    bindings: list[BufferBinding] = []
    try:
        for spec, size in zip(pipeline.intermediates, sizes, strict=True):
            bindings.append(backend.allocate_buffer(size, dtype=spec.dtype).bind("read_write"))
    except BaseException:
        backend.destroy_all([binding.handle for binding in bindings])
        raise
    return bindings


async def launch_pipeline(backend: Backend, request: PipelineLaunch) -> None:
    """Run a kernel pipeline once; see the module docstring for the rules.

    Raises :class:`InvalidArtifact` for a chain the registry cannot resolve,
    :class:`LaunchArgumentMismatch` (or :class:`LimitExceeded`) for counts,
    scalars, pools or scratch buffers that do not fit, and
    :class:`InvalidBuffer` for a buffer that is not a live buffer of
    ``backend``, all before anything is allocated or launched.

    A checkpoint first (:func:`~accy_async._loops.admit`: when many tasks
    launch at once, a few per pass of the loop): a caller cancelled there has
    enqueued nothing.
    """
    await admit()
    pool = request.artifacts
    seen_before = False
    if pool is not None:
        memo = pool.memos.get(id(request))
        if memo is not None and memo.request is request:
            if _relaunch(backend, pool, memo):
                return
            seen_before = True  # its buffers changed: packed anew below
        elif pool.seen.get(id(request)) is request:
            seen_before = True  # launched once: this time its launches are packed to keep
    pipeline = request.pipeline
    fmt = request.format
    if fmt is None:
        fmt = pool.format if pool is not None else choose_format(backend, request.registry)
    if pool is not None and pool.pipeline is pipeline and pool.registry is request.registry:
        program = _program(pipeline, pool.registry, pool.format)
    else:
        program = _program(pipeline, request.registry, fmt)
    operands, results, provided = request.operands, request.results, request.intermediates
    if len(operands) != pipeline.operand_count:
        raise LaunchArgumentMismatch(
            f"pipeline {pipeline.target!r} takes {pipeline.operand_count} operands, "
            f"got {len(operands)}",
            path="$.operands",
        )
    if len(results) != pipeline.result_count:
        raise LaunchArgumentMismatch(
            f"pipeline {pipeline.target!r} takes {pipeline.result_count} results, "
            f"got {len(results)}",
            path="$.results",
        )
    resolved = _resolve(program, request.runtime_scalar_arguments)
    if pool is not None:
        pool.accept(backend, program, fmt)
    stream = request.stream
    if stream is not None:
        if type(stream) is not StreamHandle:
            stream = backend.adopt_stream(stream)
        elif not backend.owns(stream):
            raise InvalidBuffer(f"{stream!r} is not a live stream of this backend", path="$.stream")
    backend.check_bindings(operands, "$.operands")
    backend.check_bindings(results, "$.results")
    if request.operand_shapes or request.result_shapes:
        _check_shapes(request, resolved.arguments)
    if provided is not None:
        _check_intermediates(backend, provided, resolved.intermediate_sizes, request)

    if pool is not None and provided is not None:
        # The caller owns everything: enqueue the stages and return without waiting.
        pool.streams_used.add(stream)
        if isinstance(provided, PipelineIntermediates):
            provided.streams_used.add(stream)
        sources = (operands, results, provided)
        stages = []
        for stage_index, launcher in enumerate(pool.launchers):
            buffers = _launch_stage(launcher, resolved, stage_index, sources, stream)
            if seen_before:
                prepared = launcher.prepare(buffers, resolved.stage_scalars[stage_index])
                stages.append((launcher, prepared, resolved.configs[stage_index]))
        # A request seen for the first time is only remembered (packing costs more than a
        # launch, and most requests come once); launched again, it is packed to relaunch.
        if not seen_before:
            pool.seen[id(request)] = request
            if len(pool.seen) > _MEMO_CAPACITY:
                pool.seen.popitem(last=False)
            return
        pool.seen.pop(id(request), None)
        immutable = all(isinstance(each, tuple | PipelineIntermediates) for each in sources)
        pool.memos[id(request)] = _Memo(
            request, stream, sources, (*operands, *results, *provided), tuple(stages), immutable
        )
        if len(pool.memos) > _MEMO_CAPACITY:
            pool.memos.popitem(last=False)
        return
    owned: list[BufferHandle | LoadedArtifact] = []
    try:
        if provided is None:
            intermediates: Sequence[BufferBinding] = _allocate(
                backend, pipeline, resolved.intermediate_sizes
            )
            owned.extend(binding.handle for binding in intermediates)
        else:
            intermediates = provided
            if isinstance(provided, PipelineIntermediates):
                provided.streams_used.add(stream)
        sources = (operands, results, intermediates)
        if pool is not None:
            pool.streams_used.add(stream)
            for stage_index, launcher in enumerate(pool.launchers):
                _launch_stage(launcher, resolved, stage_index, sources, stream)
        else:
            for stage_index, entry in enumerate(program.entries):
                artifact = await backend.create_artifact(entry.artifact_spec(request.diagnostic_id))
                loaded = await backend.load_artifact(artifact)
                owned.append(loaded)
                _launch_stage(
                    backend.stage_launcher(loaded), resolved, stage_index, sources, stream
                )
        await wait_stream(backend, stream)
    except BaseException:
        await release_when_idle(backend, owned, [stream])
        raise
    backend.destroy_all(owned)


def resolve_launch(
    pool: PipelineArtifactPool, arguments: Sequence[ScalarArgument | int | float]
) -> Resolution:
    """What ``arguments`` decide for ``pool``'s pipeline.

    The scalars are checked (count, types, bounds) and typed, as every launch
    checks them; the answer is cached per pipeline. Raises
    :class:`LaunchArgumentMismatch` (:class:`LimitExceeded` for a bound).
    """
    return _resolve(_program(pool.pipeline, pool.registry, pool.format), arguments)


def enqueue_checked(
    pool: PipelineArtifactPool,
    resolution: Resolution,
    operands: Sequence[BufferBinding],
    results: Sequence[BufferBinding],
    intermediates: PipelineIntermediates | None,
    stream: StreamHandle,
    *,
    track: StreamHandle | None = None,
) -> None:
    """Enqueue every stage of ``pool``'s pipeline: :func:`launch_pipeline` without its checks.

    Not a checkpoint, and it checks only that the pool and scratch are open:
    for callers that have checked the rest (counts, sizes, liveness of the
    buffers and stream) and resolved the scalars (:func:`resolve_launch`), as
    the high-level call does before each launch. The pool and scratch note
    ``track`` as the stream to wait for before they are freed (``stream`` by
    default): a caller running on a stream it does not own passes one of its
    own, made to wait for the work.
    """
    _check_open(pool, intermediates)
    pool.streams_used.add(track or stream)
    if intermediates is not None:
        intermediates.streams_used.add(track or stream)
    sources = (operands, results, intermediates or ())
    for stage_index, launcher in enumerate(pool.launchers):
        _launch_stage(launcher, resolution, stage_index, sources, stream)


def _check_open(pool: PipelineArtifactPool, intermediates: object) -> None:
    """Raise :class:`LaunchArgumentMismatch` if the pool or the scratch was closed."""
    if pool.closed:
        raise LaunchArgumentMismatch("the artifact pool is closed", path="$.artifacts")
    if isinstance(intermediates, PipelineIntermediates) and intermediates.closed:
        raise LaunchArgumentMismatch("the intermediates are closed", path="$.intermediates")


def _relaunch(backend: Backend, pool: PipelineArtifactPool, memo: _Memo) -> bool:
    """Launch a request checked in full before, re-checking only what can have changed.

    Returns ``False`` (and launches nothing) when its buffers are not the ones
    checked; raises as the full check would when one is no longer live or the
    pool or intermediates were closed.
    """
    intermediates = memo.request.intermediates
    _check_open(pool, intermediates)
    if not memo.still_holds(backend):
        return False
    stream = memo.stream
    if isinstance(intermediates, PipelineIntermediates):
        intermediates.streams_used.add(stream)
    pool.streams_used.add(stream)
    for launcher, prepared, config in memo.stages:
        launcher.launch_prepared(prepared, config, stream)
    return True


def _launch_stage(
    launcher: StageLauncher,
    resolved: Resolution,
    stage_index: int,
    sources: tuple[Sequence[BufferBinding], Sequence[BufferBinding], Sequence[BufferBinding]],
    stream: StreamHandle | None,
) -> list[BufferBinding]:
    """Enqueue stage ``stage_index``; the buffers it was given (to pack them, if wanted).

    Every buffer, the stream and the stage's counts were checked before the first launch.
    """
    buffers = [sources[source][index] for source, index in resolved.refs[stage_index]]
    launcher(buffers, resolved.stage_scalars[stage_index], resolved.configs[stage_index], stream)
    return buffers


def _check_shapes(request: PipelineLaunch, arguments: Sequence[ScalarArgument]) -> None:
    """Each operand and result holds its shape's extent, of its dtype where the buffer knows."""
    for what, bindings, shapes in (
        ("operand", request.operands, request.operand_shapes),
        ("result", request.results, request.result_shapes),
    ):
        if not shapes:
            continue
        if len(shapes) != len(bindings):
            raise LaunchArgumentMismatch(
                f"{len(shapes)} {what} shapes for {len(bindings)} {what}s",
                path=f"$.{what}_shapes",
            )
        for index, (binding, shape) in enumerate(zip(bindings, shapes, strict=True)):
            path = f"$.{what}s[{index}]"
            known = binding.handle.dtype
            # bf16 is stored as uint16: an uploaded bf16 array is recorded as u16.
            if known is not None and known.numpy_name != shape.dtype.numpy_name:
                raise LaunchArgumentMismatch(
                    f"{what} {index} ({shape.name!r}) holds {known.value}, "
                    f"the plan takes {shape.dtype.value}",
                    path=path,
                )
            count = resolve_quantity(shape.extent, arguments)
            needed = count * shape.dtype.size
            if binding.byte_size < needed:
                raise LaunchArgumentMismatch(
                    f"{what} {index} ({shape.name!r}) has {binding.byte_size} bytes, the launch "
                    f"needs {needed} ({count} {shape.dtype.value})",
                    path=path,
                )


def _check_intermediates(
    backend: Backend,
    provided: Sequence[BufferBinding],
    sizes: Sequence[int],
    request: PipelineLaunch,
) -> None:
    """Count, liveness, size, and that no scratch buffer aliases another or an operand."""
    if len(provided) != len(sizes):
        raise LaunchArgumentMismatch(
            f"the pipeline has {len(sizes)} intermediates, {len(provided)} were given",
            path="$.intermediates",
        )
    if isinstance(provided, PipelineIntermediates) and provided.closed:
        raise LaunchArgumentMismatch("the intermediates are closed", path="$.intermediates")
    backend.check_bindings(provided, "$.intermediates")
    for index, (binding, size) in enumerate(zip(provided, sizes, strict=True)):
        if binding.byte_size < size:
            raise LaunchArgumentMismatch(
                f"intermediate {index} has {binding.byte_size} bytes, the launch needs {size}",
                path=f"$.intermediates[{index}]",
            )
    if isinstance(provided, PipelineIntermediates):
        scratch: frozenset[int] | set[int] = provided.handle_ids
    else:
        scratch = {id(binding.handle) for binding in provided}
    if len(scratch) == len(provided) and not any(
        id(binding.handle) in scratch for binding in (*request.operands, *request.results)
    ):
        return
    for index, binding in enumerate(provided):  # find the first alias, to name it
        path = f"$.intermediates[{index}]"
        for other_index, other in enumerate(provided[:index]):
            if binding.aliases(other):
                raise LaunchArgumentMismatch(
                    f"intermediate {index} aliases intermediate {other_index}", path=path
                )
        for what, bindings in (("operand", request.operands), ("result", request.results)):
            for other_index, other in enumerate(bindings):
                if binding.aliases(other):
                    raise LaunchArgumentMismatch(
                        f"intermediate {index} aliases {what} {other_index}", path=path
                    )
