"""What a pipeline launches with, made once for many launches: its kernels and its scratch.

A :class:`PipelineArtifactPool` holds a chain's created and loaded kernels
(:func:`load_pipeline_artifacts`), with the launches it has seen packed for
relaunching (:class:`LaunchMemo`); :class:`PipelineIntermediates` hold its
scratch buffers (:func:`allocate_pipeline_intermediates`). Closing either
waits for the streams it was used on, then frees it. :mod:`accy_async.pipeline`
launches with them and re-exports the public names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, overload

from ._graph_cache import GraphCache
from ._loops import checkpoint
from ._pipeline_program import Program, choose_format, intermediate_byte_size, program_of
from .backends import (
    Backend,
    BufferBinding,
    GraphExec,
    GraphNode,
    KernelArtifact,
    LaunchConfig,
    LoadedArtifact,
    NodeArguments,
    StageLauncher,
    StreamHandle,
)
from .errors import InvalidBuffer, LaunchArgumentMismatch, LimitExceeded
from .plan import (
    ArtifactFormat,
    KernelCallPipeline,
    KernelCallRegistry,
    ScalarArgument,
    validate_plan,
)
from .waiting import release_when_idle

if TYPE_CHECKING:  # the launch sits above its pool; the pool only remembers launches
    from ._pipeline_program import Resolution
    from .pipeline import PipelineLaunch

__all__ = [
    "MEMO_CAPACITY",
    "SIGHTINGS",
    "LaunchLike",
    "LaunchMemo",
    "PipelineArtifactPool",
    "PipelineIntermediates",
    "PoolEntry",
    "allocate_intermediates",
    "allocate_pipeline_intermediates",
    "load_pipeline_artifacts",
]


SIGHTINGS: Final = 64
"""Geometries a pool remembers having launched (to tell a recurring one)."""

MEMO_CAPACITY: Final = 64
"""Requests a pool remembers by identity, and by likeness (the newest of each)."""


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

    def __init__(self, backend: Backend, program: Program, entries: Sequence[PoolEntry]) -> None:
        self.backend = backend
        self.pipeline = program.pipeline
        self.registry = program.registry
        self.format = program.format
        self.program = program
        """The checked chain the pool was loaded for (a launch of the same plans takes it)."""
        self.entries: tuple[PoolEntry, ...] = tuple(entries)
        self.launchers: tuple[StageLauncher, ...] = tuple(
            backend.stage_launcher(entry.loaded) for entry in self.entries
        )
        self.streams_used: set[StreamHandle | None] = set()
        self.closed = False
        self._accepted: set[tuple[int, ArtifactFormat]] = set()
        self.memos: OrderedDict[int, LaunchMemo] = OrderedDict()
        """Requests launched more than once, checked and packed for their relaunches."""
        self.seen: OrderedDict[int, PipelineLaunch] = OrderedDict()
        """Requests launched once (by id): a second launch packs them into a memo."""
        self.likes: OrderedDict[tuple[object, ...], LaunchLike] = OrderedDict()
        """Requests by what they launch (see ``pipeline._likeness``): a new request like
        one seen before is packed, and one like a packed request relaunches its memo."""
        self.graphs = GraphCache(backend)
        """The stages as one instantiated graph, per geometry."""
        self._sightings: OrderedDict[tuple[LaunchConfig, ...], None] = OrderedDict()
        """Geometries launched (the newest few): one seen again goes as a graph."""

    @property
    def target(self) -> str:
        """The chain's target, as its pipeline names it."""
        return self.pipeline.target

    @property
    def version(self) -> int:
        """The chain's version, as its pipeline gives it."""
        return self.pipeline.version

    def graph_for(self, configs: tuple[LaunchConfig, ...], wanted: bool | None) -> GraphExec | None:
        """The stages at ``configs`` as one graph (see :class:`GraphCache`)."""
        graph = self.graphs.cached(configs)  # the hot path: no closures made
        if graph is not None:
            return graph
        return self.graphs.get(
            configs,
            lambda: [
                GraphNode(entry.loaded, config, after=(index - 1,) if index else ())
                for index, (entry, config) in enumerate(zip(self.entries, configs, strict=True))
            ],
            lambda: self.streams_used,
            wanted=wanted,
            what=f"the {self.target} pipeline",
        )

    def graph_for_new(
        self, configs: tuple[LaunchConfig, ...], stream: StreamHandle
    ) -> GraphExec | None:
        """The cached graph at ``configs`` if a new request on ``stream`` may take it.

        As :meth:`takes_graph` rules: one that last ran on ``stream`` (or never
        ran, or whose stream is gone); none is made, none evicted.
        """
        graph = self.graphs.graphs.get(configs)
        return graph if graph is not None and self._free_for(graph, stream) else None

    def _free_for(self, graph: GraphExec, stream: StreamHandle) -> bool:
        """Whether a new request on ``stream`` may take ``graph`` (not running elsewhere)."""
        last = graph.last_stream
        return last is None or last is stream or not self.backend.owns(last)  # or gone

    def remember_like(self, likeness: tuple[object, ...], like: LaunchLike) -> None:
        """Keep ``like`` as what requests of ``likeness`` launch (the newest few)."""
        likes = self.likes
        likes[likeness] = like
        if len(likes) > MEMO_CAPACITY:
            likes.popitem(last=False)

    def takes_graph(self, configs: tuple[LaunchConfig, ...], stream: StreamHandle) -> bool:
        """Whether a new request at ``configs`` on ``stream`` goes as one graph by default.

        Yes when the pool's graph of that geometry last ran on ``stream`` (or
        never ran, or its stream is gone), or when the geometry recurs (the pool remembers the last
        :data:`SIGHTINGS`) and the cache has room: a new request never evicts a
        graph (a service cycling through many sizes would instantiate one per
        request), and never takes a graph running on another stream (launches of
        one graph run one after the other: the streams would wait for each other).
        """
        graphs = self.graphs
        graph = graphs.graphs.get(configs)
        if graph is not None:
            return self._free_for(graph, stream)
        sightings = self._sightings
        if configs in sightings:
            sightings.move_to_end(configs)
            return len(graphs) < graphs.capacity
        sightings[configs] = None
        if len(sightings) > SIGHTINGS:
            sightings.popitem(last=False)
        return False

    def accept(self, backend: Backend, program: Program, format: ArtifactFormat) -> None:
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
        graphs = self.graphs.take_all()
        await release_when_idle(
            self.backend,
            [*graphs, *(entry.loaded for entry in self.entries)],
            list(self.streams_used),
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
        self.checked: tuple[int, Sequence[int]] | None = None
        """The backend's :attr:`~accy_async.backends.Backend.removals` and the sizes when the
        buffers were last checked live and large enough (nothing destroyed since: they are)."""

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
class LaunchLike:
    """A request launched before, and what requests like it resolve to and relaunch.

    ``request`` is kept so that the identities in its likeness (its buffers',
    scratch's, stream's and shapes') name the same objects while it is
    remembered; ``resolved`` for the same reason. ``memo`` is ``None`` until a
    second request like it is packed.
    """

    request: PipelineLaunch
    resolved: Resolution
    memo: LaunchMemo | None


@dataclass(slots=True)
class LaunchMemo:
    """A request checked in full once, with its stages' arguments packed, for relaunching."""

    request: PipelineLaunch
    stream: StreamHandle | None
    """The request's stream, adopted (see :meth:`Backend.adopt_stream`)."""
    sequences: tuple[Sequence[BufferBinding], Sequence[BufferBinding], Sequence[BufferBinding]]
    bindings: tuple[BufferBinding, ...]
    stages: tuple[tuple[StageLauncher, Any, LaunchConfig], ...]
    """Each stage's launcher and packed arguments."""
    graph_arguments: tuple[NodeArguments, ...] | None
    """Each stage's buffers and scalars, when the request relaunches as one graph."""
    configs: tuple[LaunchConfig, ...]
    """Each stage's geometry (the graph's key in the pool)."""
    immutable: bool
    """Whether the request's sequences are tuples (or intermediates): they cannot change."""
    checked_at: int = -1
    """The backend's :attr:`~accy_async.backends.Backend.removals` when the handles were last
    seen live (nothing destroyed since: they still are)."""

    def still_holds(self, backend: Backend) -> bool:
        """Whether the request's buffers are the ones checked, and all still live.

        ``False`` too when one was destroyed since: the caller's full checks then
        refuse it under the request's own path (``$.results[0]``, say).
        """
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
        removals = backend.removals
        if removals != self.checked_at:
            try:
                backend.check_bindings(self.bindings)
            except InvalidBuffer:
                return False
            stream = self.stream
            if stream is not None and not backend.owns(stream):
                return False
            self.checked_at = removals
        return True


async def load_pipeline_artifacts(
    backend: Backend,
    pipeline: KernelCallPipeline,
    registry: KernelCallRegistry,
    format: ArtifactFormat | None = None,
) -> PipelineArtifactPool:
    """Create and load each stage's registry entry into a new pool.

    ``format`` defaults to :func:`choose_format`'s (the backend's most
    preferred that the registry has). The whole chain is checked against the
    registry first. A pipeline of several stages also readies its kernels for
    device graphs (:meth:`~accy_async.backends.Backend.prepare_graph_kernels`:
    on CUDA each gets its argument-table variant, compiled off the loop), so
    the first launch that goes as a graph does not wait for that. A failure
    (or a cancellation) part way unloads the stages already loaded.
    """
    await checkpoint()
    if format is None:
        format = choose_format(backend, registry)
    program = program_of(pipeline, registry, format)
    entries: list[PoolEntry] = []
    try:
        for entry in program.entries:
            artifact = await backend.create_artifact(entry.artifact_spec())
            entries.append(PoolEntry(artifact, await backend.load_artifact(artifact)))
        pool = PipelineArtifactPool(backend, program, entries)
        if len(entries) > 1:
            await pool.graphs.prepare([pool_entry.loaded for pool_entry in entries])
    except BaseException:
        backend.destroy_all([pool_entry.loaded for pool_entry in entries])
        raise
    return pool


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
    return PipelineIntermediates(backend, allocate_intermediates(backend, pipeline, sizes))


def allocate_intermediates(
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
