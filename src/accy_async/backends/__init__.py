"""Backends: the :class:`Backend` contract and its implementations, chosen at run time.

* ``"cuda"``: an NVIDIA GPU through cuda-python's driver API and NVRTC;
* ``"cpu"``: the embedded default, which runs CPU kernels on worker threads;
* ``"recording"``: the public test double that records calls and injects faults;
* ``"auto"``: CUDA when a GPU and its driver are present, else CPU, saying why.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeAlias

from ..errors import RuntimeUnavailable
from ._completion import ALREADY_FIRED, Completion, CompletionCallback, CompletionRegistration
from ._device_info import WAIT_POLICIES, DeviceIdentity, Limits, WaitPolicy, check_wait_policy
from ._graph_exec import GraphExec, GraphNode, NodeArguments
from ._handles import (
    DEFAULT_ALIGNMENT,
    DEFAULT_STREAM_ID,
    Access,
    BufferBinding,
    BufferHandle,
    DeviceObject,
    EventHandle,
    KernelArtifact,
    LoadedArtifact,
    Ownership,
    StreamHandle,
    StreamLike,
    SupportsCudaStream,
)
from ._launch_config import LaunchConfig
from ._launcher import StageLauncher
from ._marks import PendingRead, StreamMark
from ._trace import Tracer, TraceRecord
from .base import Backend
from .cpu import CpuBackend
from .cpu_kernels import (
    CpuKernelFunction,
    CpuLaunchContext,
    cpu_kernel,
    lookup_cpu_kernel,
    registered_cpu_kernels,
    unregister_cpu_kernel,
)
from .forecast import Anticipation
from .recording import FaultKind, RecordedLaunch, RecordingBackend

__all__ = [
    "ALREADY_FIRED",
    "DEFAULT_ALIGNMENT",
    "DEFAULT_STREAM_ID",
    "WAIT_POLICIES",
    "Access",
    "Anticipation",
    "Backend",
    "BackendKind",
    "BufferBinding",
    "BufferHandle",
    "Completion",
    "CompletionCallback",
    "CompletionRegistration",
    "CpuBackend",
    "CpuKernelFunction",
    "CpuLaunchContext",
    "DeviceIdentity",
    "DeviceObject",
    "EventHandle",
    "FaultKind",
    "GraphExec",
    "GraphNode",
    "KernelArtifact",
    "LaunchConfig",
    "Limits",
    "LoadedArtifact",
    "NodeArguments",
    "Ownership",
    "PendingRead",
    "RecordedLaunch",
    "RecordingBackend",
    "StageLauncher",
    "StreamHandle",
    "StreamLike",
    "StreamMark",
    "SupportsCudaStream",
    "TraceRecord",
    "Tracer",
    "WaitPolicy",
    "auto_backend_choice",
    "check_wait_policy",
    "cpu_kernel",
    "create_backend",
    "lookup_cpu_kernel",
    "open_backend",
    "registered_cpu_kernels",
    "unregister_cpu_kernel",
]

BackendKind: TypeAlias = Literal["auto", "cuda", "cpu", "recording"] | str
"""``auto``, ``cuda``, ``cuda:N`` (the CUDA device of ordinal ``N``), ``cpu`` or ``recording``."""

logger = logging.getLogger("accy_async")


def auto_backend_choice() -> tuple[Literal["cuda", "cpu"], str]:
    """Which backend ``"auto"`` picks here, and why."""
    try:
        from .cuda import probe_cuda  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        return "cpu", f"the CUDA backend cannot be imported ({exc})"
    available, reason = probe_cuda()
    return ("cuda" if available else "cpu"), reason


def create_backend(kind: BackendKind = "auto", **options: Any) -> Backend:
    """A new backend of ``kind``; close it with ``await backend.aclose()``.

    ``kind`` is ``auto``, ``cpu``, ``recording``, ``cuda`` (device 0 unless
    ``device=`` says otherwise) or ``cuda:N`` (device ``N``). ``options`` go to
    the backend's constructor (``limits=``, and for CUDA ``device=``). Prefer
    :func:`open_backend`, which closes it for you.
    """
    if kind.startswith("cuda:"):
        ordinal = kind.removeprefix("cuda:")
        if not (ordinal.isascii() and ordinal.isdigit()):
            raise ValueError(f"backend kind {kind!r}: expected cuda:N, N a device ordinal")
        if "device" in options:
            raise ValueError(f"backend kind {kind!r} names the device: do not pass device= too")
        kind, options = "cuda", {**options, "device": int(ordinal)}
    if kind == "auto":
        kind, reason = auto_backend_choice()
        logger.info("accy-async: auto backend is %s: %s", kind, reason)
    if kind == "cpu":
        return CpuBackend(**options)
    if kind == "recording":
        return RecordingBackend(**options)
    if kind == "cuda":
        try:
            from .cuda import CudaBackend  # type: ignore[import-not-found, unused-ignore]
        except ImportError as exc:
            raise RuntimeUnavailable(f"the CUDA backend cannot be imported: {exc}") from exc
        backend: Backend = CudaBackend(**options)
        return backend
    raise ValueError(
        f"unknown backend kind {kind!r}; expected auto, cuda, cuda:N, cpu or recording"
    )


@asynccontextmanager
async def open_backend(kind: BackendKind = "auto", **options: Any) -> AsyncIterator[Backend]:
    """Open a backend for the ``async with`` block and close it after.

    On exit the backend waits (without blocking the loop) for queued work,
    destroys deferred and leaked objects (warning about the latter), and
    releases the device.
    """
    backend = create_backend(kind, **options)
    try:
        yield backend
    finally:
        await backend.aclose()
