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

from ..backends.base import Backend, BufferBinding, BufferHandle, LoadedArtifact, StreamHandle
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
    DType,
    KernelTuningProblem,
    PipelineTuningProblem,
    ScalarArgument,
    TuningBuffer,
    resolve_quantity,
)
from ..waiting import release_when_idle

__all__ = ["KernelSubject", "PipelineSubject", "Subject", "Workspace"]

_SEED: Final = 20261201


def initial_contents(spec: TuningBuffer, rng: np.random.Generator) -> bytes:
    """The bytes a tuning buffer starts with."""
    if spec.initial == "zeros":
        return bytes(spec.byte_size)
    count = spec.byte_size // spec.dtype.size
    dtype = np.dtype(spec.dtype.numpy_name)
    if spec.dtype is DType.BF16:
        values = (rng.random(count, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    elif dtype.kind == "f":
        values = rng.random(count).astype(dtype)
    else:
        values = rng.integers(0, 100, count).astype(dtype)
    data = values.tobytes()
    return data + bytes(spec.byte_size - len(data))


class Workspace:
    """A problem's buffers on one stream: allocated, initialised, restored, released."""

    def __init__(self, backend: Backend, stream: StreamHandle) -> None:
        self.backend = backend
        self.stream = stream
        self.buffers: list[BufferHandle] = []
        self.bindings: list[BufferBinding] = []
        self._restores: list[tuple[BufferHandle, bytes]] = []
        self._flush: BufferHandle | None = None
        self._flushes = 0

    def add(self, spec: TuningBuffer, contents: bytes, access: Any = "read_write") -> None:
        """Allocate a buffer of ``spec`` and enqueue the write of ``contents`` into it."""
        buffer = self.backend.allocate_buffer(spec.byte_size)
        self.buffers.append(buffer)
        self.bindings.append(buffer.bind(access))
        self.backend.write_buffer(buffer, contents, stream=self.stream)
        if spec.restore:
            self._restores.append((buffer, contents))

    def enable_cache_flush(self) -> None:
        """Allocate the buffer whose fill evicts the device cache before each sample."""
        self._flush = self.backend.allocate_buffer(self.backend.cache_flush_bytes)
        self.buffers.append(self._flush)

    def before_sample(self) -> None:
        """Restore in-place buffers and flush the cache, in stream order, outside the timing."""
        for buffer, contents in self._restores:
            self.backend.write_buffer(buffer, contents, stream=self.stream)
        if self._flush is not None:
            self._flushes += 1
            self.backend.fill_buffer(self._flush, self._flushes, stream=self.stream)

    async def aclose(self) -> None:
        """Release the buffers once the stream is done with them."""
        buffers, self.buffers = self.buffers, []
        await release_when_idle(self.backend, buffers, [self.stream])


def kernel_workspace(
    backend: Backend, stream: StreamHandle, problem: KernelTuningProblem
) -> Workspace:
    """The buffers of a kernel problem, written from a fixed seed."""
    rng = np.random.default_rng(_SEED)
    workspace = Workspace(backend, stream)
    try:
        for spec in problem.buffers:
            workspace.add(spec, initial_contents(spec, rng))
    except BaseException:
        backend.destroy_all(workspace.buffers)
        raise
    return workspace


def pipeline_workspace(
    backend: Backend, stream: StreamHandle, problem: PipelineTuningProblem
) -> Workspace:
    """Operands (random, from a fixed seed) and zeroed results of a pipeline problem."""
    rng = np.random.default_rng(_SEED)
    workspace = Workspace(backend, stream)
    document = problem.candidates[0]
    scalars = problem.runtime_scalar_arguments
    try:
        for buffers, random, access in (
            (document.operands, True, "read_only"),
            (document.results, False, "read_write"),
        ):
            for each in buffers:
                size = max(1, resolve_quantity(each.extent, scalars)) * each.dtype.size
                spec = TuningBuffer(
                    byte_size=size, dtype=each.dtype, initial="random" if random else "zeros"
                )
                workspace.add(spec, initial_contents(spec, rng), access)
    except BaseException:
        backend.destroy_all(workspace.buffers)
        raise
    return workspace


class Subject(abc.ABC):
    """One candidate, loaded and ready to enqueue runs of itself."""

    @abc.abstractmethod
    async def enqueue(self, stream: StreamHandle) -> None:
        """Enqueue one run on ``stream`` (without waiting for it)."""

    @abc.abstractmethod
    async def aclose(self, stream: StreamHandle) -> None:
        """Release what the candidate loaded, once ``stream`` is done with it."""


class KernelSubject(Subject):
    """A compiled and loaded kernel candidate with its resolved geometry."""

    def __init__(
        self,
        backend: Backend,
        loaded: LoadedArtifact,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        geometry: tuple[tuple[int, int, int], tuple[int, int, int], int],
    ) -> None:
        self._backend = backend
        self._loaded = loaded
        self._buffers = tuple(buffers)
        self._scalars = tuple(scalars)
        self._grid, self._block, self._shared = geometry

    async def enqueue(self, stream: StreamHandle) -> None:
        """Enqueue one launch of the kernel (checked, like any launch)."""
        self._backend.launch(
            self._loaded,
            self._buffers,
            self._scalars,
            self._grid,
            self._block,
            shared_memory_bytes=self._shared,
            stream=stream,
        )

    async def aclose(self, stream: StreamHandle) -> None:
        """Unload the kernel once ``stream`` is idle."""
        await release_when_idle(self._backend, [self._loaded], [stream])


async def load_kernel_subject(
    backend: Backend, problem: KernelTuningProblem, index: int, workspace: Workspace
) -> KernelSubject:
    """Compile and load candidate ``index``.

    Its geometry is resolved first, so a bad launch rule fails before
    anything is compiled.
    """
    geometry = problem.candidates[index].launch.resolve(problem.scalars)
    artifact = await backend.create_artifact(problem.candidate_spec(index))
    loaded = await backend.load_artifact(artifact)
    return KernelSubject(backend, loaded, workspace.bindings, problem.scalars, geometry)


class PipelineSubject(Subject):
    """A pipeline candidate with its artifact pool and intermediates."""

    def __init__(
        self,
        backend: Backend,
        request: PipelineLaunch,
        pool: PipelineArtifactPool,
        scratch: PipelineIntermediates,
    ) -> None:
        self._backend = backend
        self._request = request
        self._pool = pool
        self._scratch = scratch

    async def enqueue(self, stream: StreamHandle) -> None:
        """Enqueue every stage (the request names the stream)."""
        await launch_pipeline(self._backend, self._request)

    async def aclose(self, stream: StreamHandle) -> None:
        """Release the intermediates and the pool once their streams are idle."""
        try:
            await self._scratch.aclose()
        finally:
            await self._pool.aclose()


async def load_pipeline_subject(
    backend: Backend,
    problem: PipelineTuningProblem,
    index: int,
    workspace: Workspace,
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
    operand_count = document.pipeline.operand_count
    request = PipelineLaunch(
        pipeline=document.pipeline,
        registry=document.registry,
        format=fmt,
        operands=tuple(workspace.bindings[:operand_count]),
        results=tuple(workspace.bindings[operand_count:]),
        runtime_scalar_arguments=scalars,
        intermediates=scratch,
        artifacts=pool,
        stream=workspace.stream,
    )
    return PipelineSubject(backend, request, pool, scratch)
