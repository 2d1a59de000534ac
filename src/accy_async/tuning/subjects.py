"""The things tuning runs: the problem's buffers, and each candidate made ready to enqueue.

A *workspace* holds a problem's buffers (allocated once per tuning run and
initialised from a fixed seed) and restores the in-place ones before a
sample. A *subject* is one candidate, compiled and loaded, that enqueues one
run of itself on a stream; closing it releases what it loaded once the device
is done with it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from ..backends import (
    Access,
    Backend,
    BufferBinding,
    BufferHandle,
    LaunchConfig,
    LoadedArtifact,
    StreamHandle,
)
from ..errors import UnsupportedOperation
from ..pipeline import (
    PipelineArtifactPool,
    PipelineIntermediates,
    PipelineLaunch,
    allocate_pipeline_intermediates,
    choose_format,
    launch_pipeline,
    load_pipeline_artifacts,
)
from ..plan import (
    ArtifactFormat,
    DType,
    KernelTuningProblem,
    PipelineDocument,
    PipelineTuningProblem,
    ScalarArgument,
    TuningBuffer,
    resolve_quantity,
)
from ..waiting import release_when_idle

__all__ = [
    "RANDOM_BLOCK",
    "KernelSubject",
    "PipelineSubject",
    "Subject",
    "Workspace",
    "buffer_plan",
    "create_workspace",
    "load_kernel_subject",
    "load_pipeline_subject",
]

_SEED: Final = 20261201
RANDOM_BLOCK: Final = 1 << 16
"""Random values generated per buffer; larger buffers repeat them."""


def _initial_contents(spec: TuningBuffer, rng: np.random.Generator) -> bytes | None:
    """The block of bytes a tuning buffer starts with, repeated over it; ``None`` for zeros.

    ``random`` contents are :data:`RANDOM_BLOCK` values (at most) from the
    generator; the workspace writes them once and replicates them on the
    device, so buffers of gigabytes cost no more host time than small ones.
    """
    if spec.initial == "zeros":
        return None
    count = max(1, min(spec.byte_size // spec.dtype.size, RANDOM_BLOCK))
    dtype = np.dtype(spec.dtype.numpy_name)
    values: np.ndarray[Any, Any]
    if spec.dtype is DType.BF16:
        values = (rng.random(count, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    elif dtype == np.float32 or dtype == np.float64:
        values = rng.random(count, dtype=dtype)
    elif dtype.kind == "f":
        values = rng.random(count, dtype=np.float32).astype(dtype)
    else:
        values = rng.integers(0, 100, count, dtype=dtype)
    return values.tobytes()[: spec.byte_size]


BufferPlan = list[tuple[TuningBuffer, bytes | None, Access]]
"""Each buffer of a problem with its initial contents and how kernels bind it."""


def buffer_plan(problem: KernelTuningProblem | PipelineTuningProblem) -> BufferPlan:
    """The buffers of a problem and their contents, from a fixed seed.

    CPU work (NumPy), done in a worker thread before the device is touched.
    A kernel problem's buffers are its arguments; a pipeline problem's are
    the operands (random) and results (zeroed) of its first candidate.
    """
    rng = np.random.default_rng(_SEED)
    if isinstance(problem, KernelTuningProblem):
        return [(spec, _initial_contents(spec, rng), "read_write") for spec in problem.buffers]
    document = problem.candidates[0]
    scalars = problem.runtime_scalar_arguments
    planned: BufferPlan = []
    for buffers, random, access in (
        (document.operands, True, "read_only"),
        (document.results, False, "read_write"),
    ):
        for each in buffers:
            size = max(1, resolve_quantity(each.extent, scalars)) * each.dtype.size
            spec = TuningBuffer(
                byte_size=size, dtype=each.dtype, initial="random" if random else "zeros"
            )
            planned.append((spec, _initial_contents(spec, rng), access))  # type: ignore[arg-type]
    return planned


class Workspace:
    """A problem's buffers on one stream: allocated, initialised, restored, released."""

    def __init__(self, backend: Backend, stream: StreamHandle) -> None:
        self.backend = backend
        self.stream = stream
        self.buffers: list[BufferHandle] = []
        self.bindings: list[BufferBinding] = []
        self._restores: list[tuple[BufferHandle, BufferHandle | None]] = []
        self._flush: BufferHandle | None = None
        self._flushes = 0

    def add(
        self, spec: TuningBuffer, contents: bytes | None, access: Access = "read_write"
    ) -> None:
        """Allocate a buffer of ``spec`` and enqueue its initial contents.

        ``contents`` is a block repeated over the buffer (``None``: zeros). A
        ``restore`` buffer of non-zero contents gets a pristine twin on the
        device, copied back before every sample.
        """
        buffer = self._allocate(spec.byte_size)
        self.bindings.append(buffer.bind(access))
        self._initialise(buffer, contents)
        if not spec.restore:
            return
        if contents is None:
            self._restores.append((buffer, None))
            return
        pristine = self._allocate(spec.byte_size)
        self.backend.copy_buffer(buffer, pristine, stream=self.stream)
        self._restores.append((buffer, pristine))

    def _allocate(self, byte_size: int) -> BufferHandle:
        buffer = self.backend.allocate_buffer(byte_size)
        self.buffers.append(buffer)
        return buffer

    def _initialise(self, buffer: BufferHandle, block: bytes | None) -> None:
        backend, stream = self.backend, self.stream
        if block is None:
            self._zero(buffer)
            return
        size = buffer.byte_size
        backend.write_buffer(buffer, block[:size], stream=stream)
        filled = min(len(block), size)
        while filled < size:  # double the written prefix on the device
            step = min(filled, size - filled)
            backend.copy_buffer(buffer, buffer, step, destination_offset=filled, stream=stream)
            filled += step

    def _zero(self, buffer: BufferHandle) -> None:
        try:
            self.backend.fill_buffer(buffer, 0, stream=self.stream)
        except UnsupportedOperation:
            self.backend.write_buffer(buffer, bytes(buffer.byte_size), stream=self.stream)

    def enable_cache_flush(self) -> None:
        """Allocate the buffer whose fill evicts the device cache before each sample."""
        self._flush = self._allocate(self.backend.cache_flush_bytes)

    def before_sample(self) -> None:
        """Restore in-place buffers and flush the cache, in stream order, outside the timing."""
        for buffer, pristine in self._restores:
            if pristine is None:
                self._zero(buffer)
            else:
                self.backend.copy_buffer(pristine, buffer, stream=self.stream)
        if self._flush is not None:
            self._flushes += 1
            self.backend.fill_buffer(self._flush, self._flushes, stream=self.stream)

    async def aclose(self) -> None:
        """Release the buffers once the stream is done with them."""
        buffers, self.buffers = self.buffers, []
        await release_when_idle(self.backend, buffers, [self.stream])


def create_workspace(
    backend: Backend, stream: StreamHandle, planned: BufferPlan, *, flush_cache: bool = False
) -> Workspace:
    """Allocate the planned buffers and enqueue their initial contents on ``stream``."""
    workspace = Workspace(backend, stream)
    try:
        for spec, contents, access in planned:
            workspace.add(spec, contents, access)
        if flush_cache:
            workspace.enable_cache_flush()
    except BaseException:
        backend.destroy_all(workspace.buffers)
        raise
    return workspace


class Subject(abc.ABC):
    """One candidate, loaded and ready to enqueue runs of itself once bound to buffers."""

    @abc.abstractmethod
    def bind(self, workspace: Workspace) -> None:
        """Run on ``workspace``'s buffers and stream from now on."""

    @abc.abstractmethod
    async def enqueue(self, stream: StreamHandle) -> None:
        """Enqueue one run on ``stream`` (without waiting for it)."""

    @abc.abstractmethod
    async def aclose(self, stream: StreamHandle | None) -> None:
        """Release what the candidate loaded, once ``stream`` is done with it."""


class KernelSubject(Subject):
    """A compiled and loaded kernel candidate with its resolved geometry."""

    def __init__(
        self,
        backend: Backend,
        loaded: LoadedArtifact,
        scalars: Sequence[ScalarArgument],
        geometry: tuple[tuple[int, int, int], tuple[int, int, int], int],
    ) -> None:
        self._backend = backend
        self._loaded = loaded
        self._buffers: tuple[BufferBinding, ...] = ()
        self._scalars = tuple(scalars)
        self._config = LaunchConfig(*geometry)

    def bind(self, workspace: Workspace) -> None:
        """Launch on the workspace's buffers, in argument order."""
        self._buffers = tuple(workspace.bindings)

    async def enqueue(self, stream: StreamHandle) -> None:
        """Enqueue one launch of the kernel (checked, like any launch)."""
        self._backend.launch(
            self._loaded,
            self._buffers,
            self._scalars,
            self._config,
            stream=stream,
        )

    async def aclose(self, stream: StreamHandle | None) -> None:
        """Unload the kernel once ``stream`` is idle."""
        await release_when_idle(self._backend, [self._loaded], [stream])


async def load_kernel_subject(
    backend: Backend, problem: KernelTuningProblem, index: int
) -> KernelSubject:
    """Compile and load candidate ``index``.

    Its geometry is resolved first, so a bad launch rule fails before
    anything is compiled.
    """
    geometry = problem.candidates[index].launch.resolve(problem.scalars)
    artifact = await backend.create_artifact(problem.candidate_spec(index))
    loaded = await backend.load_artifact(artifact)
    return KernelSubject(backend, loaded, problem.scalars, geometry)


class PipelineSubject(Subject):
    """A pipeline candidate with its artifact pool and intermediates."""

    def __init__(
        self,
        backend: Backend,
        document: PipelineDocument,
        format: ArtifactFormat,
        scalars: Sequence[ScalarArgument],
        pool: PipelineArtifactPool,
        scratch: PipelineIntermediates,
    ) -> None:
        self._backend = backend
        self._document = document
        self._format = format
        self._scalars = tuple(scalars)
        self._pool = pool
        self._scratch = scratch
        self._request: PipelineLaunch | None = None

    def bind(self, workspace: Workspace) -> None:
        """Take operands and results from the workspace, and run on its stream."""
        operand_count = self._document.pipeline.operand_count
        self._request = PipelineLaunch(
            pipeline=self._document.pipeline,
            registry=self._document.registry,
            format=self._format,
            operands=tuple(workspace.bindings[:operand_count]),
            results=tuple(workspace.bindings[operand_count:]),
            runtime_scalar_arguments=self._scalars,
            intermediates=self._scratch,
            artifacts=self._pool,
            stream=workspace.stream,
        )

    async def enqueue(self, stream: StreamHandle) -> None:
        """Enqueue every stage on the bound workspace's stream."""
        assert self._request is not None, "bind the subject first"
        await launch_pipeline(self._backend, self._request)

    async def aclose(self, stream: StreamHandle | None) -> None:
        """Release the intermediates and the pool once their streams are idle."""
        try:
            await self._scratch.aclose()
        finally:
            await self._pool.aclose()


async def load_pipeline_subject(
    backend: Backend, problem: PipelineTuningProblem, index: int
) -> PipelineSubject:
    """Compile and load every stage of candidate ``index`` and allocate its intermediates."""
    document = problem.candidates[index]
    scalars = problem.runtime_scalar_arguments
    fmt = choose_format(backend, document)
    pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry, fmt)
    try:
        scratch = await allocate_pipeline_intermediates(backend, document.pipeline, scalars)
    except BaseException:
        await pool.aclose()
        raise
    return PipelineSubject(backend, document, fmt, scalars, pool, scratch)
