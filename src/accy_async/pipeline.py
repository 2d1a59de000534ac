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
reusing or freeing the buffers. After an error, the call waits (bounded)
for what it enqueued and destroys every object it owns, even when that wait
fails; after a cancellation it returns at once and what it owns goes to
deferred release (destroyed once the stream has run what was enqueued).

To launch one chain many times, load a :class:`PipelineArtifactPool` and
allocate :class:`PipelineIntermediates` once::

    pool = await load_pipeline_artifacts(backend, pipeline, registry, fmt)
    scratch = await allocate_pipeline_intermediates(backend, pipeline, scalars)
    async with pool, scratch:
        await launch_pipeline(backend, PipelineLaunch(..., artifacts=pool, intermediates=scratch))

This module checks and launches requests. The pool and the scratch live in
:mod:`accy_async._pipeline_pool`, the chain checked against its registry and
what the runtime scalars decide in :mod:`accy_async._pipeline_program`; their
public names are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import msgspec

from . import _loops
from ._loops import admit
from ._pipeline_pool import (
    MEMO_CAPACITY,
    LaunchLike,
    LaunchMemo,
    PipelineArtifactPool,
    PipelineIntermediates,
    PoolEntry,
    allocate_intermediates,
    allocate_pipeline_intermediates,
    load_pipeline_artifacts,
)
from ._pipeline_program import (
    Resolution,
    choose_format,
    intermediate_byte_size,
    program_of,
    resolve_program,
)
from .backends import (
    Backend,
    BufferBinding,
    BufferHandle,
    GraphExec,
    LaunchConfig,
    LoadedArtifact,
    NodeArguments,
    StageLauncher,
    StreamHandle,
    StreamLike,
)
from .errors import (
    InvalidBuffer,
    LaunchArgumentMismatch,
)
from .plan import (
    ArtifactFormat,
    KernelCallPipeline,
    KernelCallRegistry,
    PipelineBuffer,
    PipelineDocument,
    ScalarArgument,
    resolve_quantity,
)
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
    "launch_packed",
    "launch_pipeline",
    "load_pipeline_artifacts",
    "pack_stages",
    "resolve_launch",
]

_logger: Final = logging.getLogger("accy_async")


class PipelineLaunch(msgspec.Struct, frozen=True):
    """One run of a pipeline (the seed's ``PipelineLaunch``).

    ``intermediates`` and ``artifacts`` are optional: without them the call
    allocates and loads what it needs and waits for completion before freeing
    it. ``stream`` defaults to the backend's default stream.

    Immutable (a frozen struct, cheap to make: a request per call costs about
    0.2 µs); change one with :func:`msgspec.structs.replace`. It holds live
    handles, so it is not encoded: a plan document (:class:`PipelineDocument`)
    is what travels.
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
    device_graph: bool | None = None
    """Whether the stages go to the device as one graph (see :meth:`Backend.instantiate_graph`).

    ``None`` (the default) decides: a request of two or more stages through
    a pool with its scratch goes as one graph when its geometry came before
    (the same ``PipelineLaunch`` relaunched, or a new request whose scalars
    give launch configurations the pool has launched already), instantiated
    once per geometry and kept by the pool; a relaunched request patches
    nothing (one submission for every stage), a new one puts its buffers and
    scalars in. The first request of a geometry goes stage by stage: a
    service whose every request has a new size would pay an instantiation per
    size for nothing. A backend that cannot make graphs falls back to one
    launch per stage, saying so once in the log.
    ``True``: every launch through a pool with its scratch goes as a graph
    (arguments patched in as they change), and a failure to make one raises.
    ``False``: one launch per stage, always."""

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
        device_graph: bool | None = None,
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
            device_graph=device_graph,
        )


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
        program = pool.program
    else:
        program = program_of(pipeline, request.registry, fmt)
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
    resolved = resolve_program(program, request.runtime_scalar_arguments)
    likeness = None
    alike = False  # like a request launched before: packed, but the graph rules of a new one
    if (
        not seen_before
        and pool is not None
        and provided is not None
        and program is pool.program
        and backend is pool.backend
    ):
        # A new request like one launched before (the same buffers, scalars, scratch and
        # stream; most services make a request per call): relaunched as that one is.
        likeness = _likeness(request, resolved)
        if likeness is not None:
            like = pool.likes.get(likeness)
            if like is not None:
                # A buffer or stream gone makes the relaunch decline: the checks below name
                # it in this request.
                if like.memo is not None and _relaunch(backend, pool, like.memo, new_request=True):
                    return
                alike = True
    given = request.stream
    stream = (
        given if given is None or isinstance(given, StreamHandle) else backend.adopt_stream(given)
    )
    as_graph = False
    if pool is not None:
        pool.accept(backend, program, fmt)
        if provided is not None:
            as_graph = _as_graph(request, seen_before, pool, resolved.configs, stream)
            if as_graph and not pool.graphs.prepared:  # a pool of one stage, asked for a graph
                await pool.graphs.prepare([entry.loaded for entry in pool.entries])
                pool.accept(backend, program, fmt)  # still open after the await
                stream = _adopted_again(backend, stream, given)
                # Other launches may have made or taken graphs meanwhile: decide again.
                as_graph = _as_graph(request, seen_before, pool, resolved.configs, stream)
    if stream is given and stream is not None and not backend.owns(stream):
        raise InvalidBuffer(f"{stream!r} is not a live stream of this backend", path="$.stream")
    backend.check_bindings(operands, "$.operands")
    backend.check_bindings(results, "$.results")
    if request.operand_shapes or request.result_shapes:
        _check_shapes(request, resolved.arguments)
    if provided is not None:
        _check_intermediates(backend, provided, resolved.intermediate_sizes, request)
    if pool is not None and provided is not None:
        # The caller owns everything: enqueue the stages and return without waiting.
        _enqueue_with_pool(
            backend, request, pool, resolved, stream, seen_before or alike, as_graph, likeness
        )
        return
    owned: list[BufferHandle | LoadedArtifact] = []
    loading = False
    try:
        if provided is None:
            intermediates: Sequence[BufferBinding] = allocate_intermediates(
                backend, pipeline, resolved.intermediate_sizes
            )
            owned.extend(binding.handle for binding in intermediates)
        else:
            intermediates = provided
            if isinstance(provided, PipelineIntermediates):
                provided.streams_used.add(stream)
        arguments = _stage_arguments(resolved, operands, results, intermediates)
        if pool is not None:
            pool.streams_used.add(stream)
            _launch_stages(pool.launchers, arguments, resolved, stream)
        else:
            for stage_index, entry in enumerate(program.entries):
                loading = True
                artifact = await backend.create_artifact(entry.artifact_spec(request.diagnostic_id))
                loaded = await backend.load_artifact(artifact)
                loading = False
                owned.append(loaded)
                buffers, scalars = arguments[stage_index]
                backend.stage_launcher(loaded)(
                    buffers, scalars, resolved.configs[stage_index], stream
                )
        await wait_stream(backend, stream)
    except BaseException:
        if loading and _loops.cancelled():
            # Cancelled while a worker thread loads a kernel. The driver holds every other
            # thread's launches, records and allocations until that load ends, and the load
            # waits for the kernels running on the device: hand what this call owns to
            # deferred release without a driver call (the backend's next call takes it).
            backend.release_from_any_thread(owned, after=stream)
            raise
        await release_when_idle(backend, owned, [stream])
        raise
    backend.destroy_all(owned)


def _enqueue_with_pool(
    backend: Backend,
    request: PipelineLaunch,
    pool: PipelineArtifactPool,
    resolved: Resolution,
    stream: StreamHandle | None,
    seen_before: bool,
    as_graph: bool,
    likeness: tuple[object, ...] | None,
) -> None:
    """Enqueue a checked request that brings its pool and scratch, and remember it.

    A request seen for the first time is only remembered (packing costs more
    than a launch, and most requests come once): by its ``likeness`` when it
    has one (see :func:`_likeness`), else by identity. Launched again (or one
    like it), its stages' arguments are packed into a :class:`LaunchMemo` for
    its relaunches, kept by identity and by likeness.
    """
    operands, results, provided = request.operands, request.results, request.intermediates
    assert provided is not None
    pool.streams_used.add(stream)
    if isinstance(provided, PipelineIntermediates):
        provided.streams_used.add(stream)
    arguments = _stage_arguments(resolved, operands, results, provided)
    graph = pool.graph_for(resolved.configs, request.device_graph) if as_graph else None
    if graph is not None:
        backend.launch_graph_exec_trusted(graph, arguments, stream)
    else:
        _launch_stages(pool.launchers, arguments, resolved, stream)
    if not seen_before:
        if likeness is not None:
            pool.remember_like(likeness, LaunchLike(request, resolved, None))
            return
        pool.seen[id(request)] = request
        if len(pool.seen) > MEMO_CAPACITY:
            pool.seen.popitem(last=False)
        return
    pool.seen.pop(id(request), None)
    stages = _packed(pool.launchers, arguments, resolved.configs)
    sequences = (operands, results, provided)
    memo = pool.memos[id(request)] = LaunchMemo(
        request,
        stream,
        sequences,
        (*operands, *results, *provided),
        stages,
        arguments if as_graph else None,
        resolved.configs,
        all(isinstance(each, tuple | PipelineIntermediates) for each in sequences),
    )
    if len(pool.memos) > MEMO_CAPACITY:
        pool.memos.popitem(last=False)
    if likeness is not None:
        pool.remember_like(likeness, LaunchLike(request, resolved, memo))


def resolve_launch(
    pool: PipelineArtifactPool, arguments: Sequence[ScalarArgument | int | float]
) -> Resolution:
    """What ``arguments`` decide for ``pool``'s pipeline.

    The scalars are checked (count, types, bounds) and typed, as every launch
    checks them; the answer is cached per pipeline. Raises
    :class:`LaunchArgumentMismatch` (:class:`LimitExceeded` for a bound).
    """
    return resolve_program(pool.program, arguments)


def enqueue_checked(
    pool: PipelineArtifactPool,
    resolution: Resolution,
    operands: Sequence[BufferBinding],
    results: Sequence[BufferBinding],
    intermediates: PipelineIntermediates | None,
    stream: StreamHandle,
    *,
    track: StreamHandle | None = None,
    device_graph: bool = False,
) -> None:
    """Enqueue every stage of ``pool``'s pipeline: :func:`launch_pipeline` without its checks.

    Not a checkpoint, and it checks only that the pool and scratch are open:
    for callers that have checked the rest (counts, sizes, liveness of the
    buffers and stream) and resolved the scalars (:func:`resolve_launch`), as
    the high-level call does before each launch. The pool and scratch note
    ``track`` as the stream to wait for before they are freed (``stream`` by
    default): a caller running on a stream it does not own passes one of its
    own, made to wait for the work. With ``device_graph=True`` the stages go
    as one graph of the pool (instantiated once per geometry, buffers and
    scalars patched in each call); by default stage by stage.
    """
    _check_open(pool, intermediates)
    pool.streams_used.add(track or stream)
    if intermediates is not None:
        intermediates.streams_used.add(track or stream)
    arguments = _stage_arguments(resolution, operands, results, intermediates or ())
    graph = pool.graph_for(resolution.configs, True) if device_graph else None
    if graph is not None:
        pool.backend.launch_graph_exec_trusted(graph, arguments, stream)
    else:
        _launch_stages(pool.launchers, arguments, resolution, stream)


def pack_stages(
    pool: PipelineArtifactPool,
    resolution: Resolution,
    operands: Sequence[BufferBinding],
    results: Sequence[BufferBinding],
    intermediates: PipelineIntermediates | None,
) -> tuple[tuple[NodeArguments, ...], tuple[tuple[StageLauncher, object, LaunchConfig], ...]]:
    """Each stage's arguments, and each stage packed for relaunching.

    The stages as :func:`enqueue_checked` would launch them, each
    ``(launcher, launcher.prepare(buffers, scalars), geometry)``.
    """
    arguments = _stage_arguments(resolution, operands, results, intermediates or ())
    return arguments, _packed(pool.launchers, arguments, resolution.configs)


def launch_packed(
    backend: Backend,
    stages: Sequence[tuple[StageLauncher, object, LaunchConfig]],
    stream: StreamHandle | None,
    graph: GraphExec | None = None,
    graph_arguments: Sequence[NodeArguments] = (),
) -> None:
    """Enqueue stages packed by :func:`pack_stages`.

    As ``graph`` (its nodes given ``graph_arguments``) when there is one,
    else one prepared launch a stage.
    """
    if graph is not None:
        backend.launch_graph_exec_trusted(graph, graph_arguments, stream)
        return
    for launcher, prepared, config in stages:
        launcher.launch_prepared(prepared, config, stream)


def _packed(
    launchers: Sequence[StageLauncher],
    arguments: Sequence[NodeArguments],
    configs: Sequence[LaunchConfig],
) -> tuple[tuple[StageLauncher, object, LaunchConfig], ...]:
    """Each stage's ``(launcher, its arguments prepared, geometry)``, for relaunching."""
    return tuple(
        (launcher, launcher.prepare(buffers, scalars), config)
        for launcher, (buffers, scalars), config in zip(launchers, arguments, configs, strict=True)
    )


def _adopted_again(
    backend: Backend, stream: StreamHandle | None, given: StreamLike | None
) -> StreamHandle | None:
    """``stream``, adopted from ``given`` again if it was forgotten during an await."""
    if stream is None or given is None or stream is given or backend.owns(stream):
        return stream
    return backend.adopt_stream(given)


def _as_graph(
    request: PipelineLaunch,
    seen_before: bool,
    pool: PipelineArtifactPool,
    configs: tuple[LaunchConfig, ...],
    stream: StreamHandle | None,
) -> bool:
    """Whether a launch through a pool and scratch goes as one device graph.

    ``True`` and ``False`` as the request says; ``None``: a request of several
    stages launched before, or a new one whose geometry recurs on its stream
    (:meth:`PipelineArtifactPool.takes_graph`), where the backend makes graphs.
    """
    wanted = request.device_graph
    if wanted is not None:
        return wanted
    if len(pool.launchers) < 2 or pool.graphs.unavailable is not None:
        return False
    return seen_before or pool.takes_graph(configs, stream or pool.backend.default_stream)


def _check_open(pool: PipelineArtifactPool, intermediates: object) -> None:
    """Raise :class:`LaunchArgumentMismatch` if the pool or the scratch was closed."""
    if pool.closed:
        raise LaunchArgumentMismatch("the artifact pool is closed", path="$.artifacts")
    _refuse_closed_scratch(intermediates)


def _refuse_closed_scratch(intermediates: object) -> None:
    """Raise :class:`LaunchArgumentMismatch` if ``intermediates`` is a closed scratch set."""
    if isinstance(intermediates, PipelineIntermediates) and intermediates.closed:
        raise LaunchArgumentMismatch("the intermediates are closed", path="$.intermediates")


def _relaunch(
    backend: Backend, pool: PipelineArtifactPool, memo: LaunchMemo, *, new_request: bool = False
) -> bool:
    """Launch a request checked in full before, re-checking only what can have changed.

    Returns ``False`` (and launches nothing) when its buffers are not the ones
    checked or one of them (or its stream) is no longer live, so that the full
    checks name it; raises as they would when the pool or intermediates were
    closed. For a ``new_request`` like the memo's (not the memo's own), a graph
    is taken as for any new request (:meth:`PipelineArtifactPool.graph_for_new`)
    unless it asks for graphs.
    """
    intermediates = memo.request.intermediates
    _check_open(pool, intermediates)
    if not memo.still_holds(backend):
        return False
    stream = memo.stream
    if isinstance(intermediates, PipelineIntermediates):
        intermediates.streams_used.add(stream)
    pool.streams_used.add(stream)
    graph = None
    if memo.graph_arguments is not None:
        wanted = memo.request.device_graph
        if new_request and wanted is None:
            graph = pool.graph_for_new(memo.configs, stream or backend.default_stream)
        else:
            graph = pool.graph_for(memo.configs, wanted)
    launch_packed(backend, memo.stages, stream, graph, memo.graph_arguments or ())
    return True


def _likeness(request: PipelineLaunch, resolved: Resolution) -> tuple[object, ...] | None:
    """What makes ``request`` launch as another did, or ``None`` when it cannot tell cheaply.

    Two requests through one pool launch alike when they bind the same
    buffers (by handle, range and access) and scratch, on the same stream,
    with scalars that resolve alike (one :class:`Resolution`: a request with
    ``5.0`` where one had ``5`` resolves on its own), the same format, graph
    choice and shapes to check. Identities in the key stay valid while the
    pool keeps the request they were read from (:class:`LaunchLike`).
    Scratch built by hand (a sequence of bindings) is not compared: ``None``.
    """
    provided = request.intermediates
    if isinstance(provided, PipelineIntermediates):
        scratch = id(provided)
    elif provided is not None and not provided:
        scratch = 0
    else:
        return None
    stream = request.stream
    operands = request.operands
    parts: list[object] = [
        id(resolved),
        request.format,
        request.device_graph,
        stream if stream.__class__ is int else None,  # a raw handle, by value
        None if stream is None or stream.__class__ is int else id(stream),
        id(request.operand_shapes),
        id(request.result_shapes),
        scratch,
        len(operands),
    ]
    for binding in (*operands, *request.results):
        parts += (id(binding.handle), binding.offset, binding.byte_size, binding.access)
    return tuple(parts)


def _stage_arguments(
    resolved: Resolution,
    operands: Sequence[BufferBinding],
    results: Sequence[BufferBinding],
    intermediates: Sequence[BufferBinding],
) -> tuple[NodeArguments, ...]:
    """Each stage's ``(buffers, scalars)``: its buffers picked from the launch's, end to end."""
    if isinstance(intermediates, PipelineIntermediates):
        intermediates = intermediates.bindings  # a tuple: unpacked without Python calls
    flat = (*operands, *results, *intermediates)
    return tuple(
        zip([pick(flat) for pick in resolved.pickers], resolved.stage_scalars, strict=True)
    )


def _launch_stages(
    launchers: Sequence[StageLauncher],
    arguments: Sequence[NodeArguments],
    resolved: Resolution,
    stream: StreamHandle | None,
) -> None:
    """Enqueue every stage, one launch each (everything was checked before the first)."""
    for launcher, (buffers, scalars), config in zip(
        launchers, arguments, resolved.configs, strict=True
    ):
        launcher(buffers, scalars, config, stream)


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
    _refuse_closed_scratch(provided)
    if not provided and not sizes:
        return  # no scratch needed, none given
    scratch: frozenset[int] | set[int]
    if isinstance(provided, PipelineIntermediates) and provided.backend is backend:
        removals = backend.removals
        if provided.checked != (removals, sizes):
            _check_scratch(backend, provided.bindings, sizes)
            provided.checked = (removals, sizes)
        scratch = provided.handle_ids
    else:
        _check_scratch(backend, provided, sizes)
        scratch = {id(binding.handle) for binding in provided}
    # Distinct (a set built by hand may repeat a buffer) and none an operand or result.
    if len(scratch) == len(provided) and scratch.isdisjoint(
        [id(binding.handle) for binding in (*request.operands, *request.results)]
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


def _check_scratch(
    backend: Backend, provided: Sequence[BufferBinding], sizes: Sequence[int]
) -> None:
    """Each scratch buffer is given, live and at least its intermediate's size."""
    if len(provided) != len(sizes):
        raise LaunchArgumentMismatch(
            f"the pipeline has {len(sizes)} intermediates, {len(provided)} were given",
            path="$.intermediates",
        )
    backend.check_bindings(provided, "$.intermediates")
    for index, (binding, size) in enumerate(zip(provided, sizes, strict=True)):
        if binding.byte_size < size:
            raise LaunchArgumentMismatch(
                f"intermediate {index} has {binding.byte_size} bytes, the launch needs {size}",
                path=f"$.intermediates[{index}]",
            )
