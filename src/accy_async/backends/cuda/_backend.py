"""The CUDA backend: an NVIDIA GPU through cuda-python's driver API and NVRTC.

* **Device and context**: device ``device`` (0 by default) and its primary
  context, made current on the thread that opens the backend (use the backend
  from that thread: the event loop's) and on the backend's own threads.
* **Buffers**: ``cuMemAlloc`` (256-byte aligned or better); copies through
  pinned staging memory (``cuMemHostAlloc``, pooled) so that host-to-device
  and device-to-host copies are truly asynchronous in stream order; 32-bit
  fills with ``cuMemsetD32Async``. A destroyed buffer's memory is kept for
  the next allocations that fit it (``memory_cache_bytes`` at most: by default
  a sixteenth of the device's memory, at most 4 GiB; 0 keeps none), and a
  destroyed kernel's module for the next load of its image (neither when
  the environment sets ``ACCY_CUDA_NO_CACHING``, for compute-sanitizer's
  memcheck to see every free): ``cuMemFree`` and module loads wait for every
  kernel running on the device, and the driver holds every other thread's
  launches, records and allocations meanwhile. The frees, unloads and loads
  that remain run on worker threads, each after waiting for the device's
  running work without holding the driver; on the event loop's thread only
  when an allocation runs out of memory (the kept blocks are freed there,
  as a last resort, and the allocation tried again).
* **Artifacts**: CUDA C++ compiled by NVRTC to a cubin for the device (PTX as
  the fallback), or PTX or cubin payloads; compiling and loading run in worker
  threads. Each loaded kernel keeps one packed argument array (a ``void*``
  array over an 8-byte slot per argument) that every launch refills in place.
* **Streams and events**: non-blocking streams; events without timing (the
  backend's own completion markers pooled); device-side waits with
  ``cuStreamWaitEvent``; non-blocking queries.
* **Completion**: a :class:`~accy_async.backends.cuda.reactor.CompletionReactor`.
* **Faults**: every ``CUresult`` is translated; sticky ones poison the backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any, Final

import anyio.lowlevel
import anyio.to_thread
import numpy as np

from ...errors import (
    DeviceFault,
    InvalidBuffer,
    RuntimeUnavailable,
    UnsupportedOperation,
)
from ...plan import ArtifactFormat, ArtifactSpec, ScalarArgument
from .._completion import ALREADY_FIRED, Completion, CompletionCallback, CompletionRegistration
from .._device_info import DeviceIdentity, Limits, WaitPolicy
from .._graph_exec import GraphExec, GraphNode, NodeArguments
from .._handles import (
    DEFAULT_STREAM_ID,
    BufferBinding,
    BufferHandle,
    DeviceObject,
    EventHandle,
    KernelArtifact,
    LoadedArtifact,
    StreamHandle,
)
from .._launch_config import LaunchConfig
from .._launcher import StageLauncher
from .._marks import PendingRead, StreamMark
from .._trace import TraceRecord
from ..base import Backend
from ..forecast import Anticipation, byte_features
from ._artifacts import (
    create_artifact,
    load_kernel,
    load_table_variants,
    shelve_kernel,
    unload_shelved,
)
from ._device import DeviceState, DriverResults
from ._graphs import destroy_graph, instantiate_graph, launch_graph
from ._launch import CudaStageLauncher, Kernel
from ._marks import CudaRead, CudaStreamMark
from ._memory import Allocation, quiet_device
from ._module_shelf import ShelvedModule
from .compile_pool import CompilePool, shared_compile_pool
from .driver import driver, initialised_driver, probe_cuda
from .nvrtc import nvrtc_version

__all__ = ["CudaBackend", "probe_cuda"]

_PER_THREAD_STREAM: Final = 2
"""CU_STREAM_PER_THREAD; 0 and 1 are the NULL and legacy streams: handles of no context."""
_GRANULE: Final = 512
"""Allocations are rounded up to this many bytes (kept blocks are reused by size)."""
_MEMORY_CACHE_CEILING: Final = 4 << 30
"""The most device memory kept for reuse by default (else a sixteenth of ``limits``')."""


class CudaBackend(Backend):
    """An NVIDIA GPU through cuda-python; see the module docstring."""

    kind = "cuda"

    def __init__(
        self,
        *,
        device: int = 0,
        limits: Limits | None = None,
        poll_interval: float = 50e-6,
        anticipation: bool = True,
        wait_policy: WaitPolicy = "balanced",
        memory_cache_bytes: int | None = None,
    ) -> None:
        super().__init__(limits=limits, wait_policy=wait_policy)
        if memory_cache_bytes is not None and memory_cache_bytes < 0:
            raise ValueError(f"memory_cache_bytes must be 0 or more, got {memory_cache_bytes}")
        self._results = DriverResults(self.poison)
        self.polled_from_loop = anticipation
        self._compile_pool: CompilePool | None = None
        d = initialised_driver()
        count = int(self._results.value(d.cuDeviceGetCount(), "counting the devices"))
        if not 0 <= device < count:
            raise RuntimeUnavailable(
                f"there is no CUDA device {device}: this machine has {count} "
                f"(ordinals 0-{count - 1})"
                if count
                else f"there is no CUDA device {device}: this machine has none"
            )
        self._device = self._results.value(d.cuDeviceGet(device), f"opening device {device}")
        self._ordinal = device
        raw = self._results.value(d.cuDeviceGetName(256, self._device), "reading the device name")
        self._name = raw.split(b"\0", 1)[0].decode(errors="replace")
        attribute = d.CUdevice_attribute
        self._compute_capability = (
            int(
                self._results.value(
                    d.cuDeviceGetAttribute(
                        attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._device
                    ),
                    "cc",
                )
            ),
            int(
                self._results.value(
                    d.cuDeviceGetAttribute(
                        attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._device
                    ),
                    "cc",
                )
            ),
        )
        self._l2_bytes = int(
            self._results.value(
                d.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, self._device),
                "reading the L2 cache size",
            )
        )
        self._identity = self._read_identity()
        total = int(
            self._results.value(d.cuDeviceTotalMem(self._device), "reading the memory size")
        )
        if limits is None:
            self.limits = Limits(max_buffer_bytes=total, max_total_bytes=total)
        self._context = self._results.value(
            d.cuDevicePrimaryCtxRetain(self._device), "retaining the primary context"
        )
        self._results.check(d.cuCtxSetCurrent(self._context), "making the context current")
        self._default_native = self._results.value(
            d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "creating a stream"
        )
        self._default_stream = StreamHandle(
            self.backend_id, DEFAULT_STREAM_ID, self._default_native
        )
        device_state = DeviceState(
            self,
            self._context,
            health=self._health,
            poison=self.poison,
            poll_interval=poll_interval,
            memory_cache_bytes=(
                min(self.limits.max_total_bytes // 16, _MEMORY_CACHE_CEILING)
                if memory_cache_bytes is None
                else memory_cache_bytes
            ),
            keep_nothing=bool(os.environ.get("ACCY_CUDA_NO_CACHING")),
        )
        device_state.track(DEFAULT_STREAM_ID)
        self._device_state = device_state
        self._peers: dict[int, bool] = {}
        """Peer contexts seen by copies, by handle: whether this one reaches them directly."""
        self._copy_costs = {
            kind: device_state.forecast.model(kind, kind, byte_features)
            for kind in ("copy to the device", "copy to the host", "copy on the device", "fill")
        }

    def _read_identity(self) -> DeviceIdentity:
        d = driver()
        get_uuid = getattr(d, "cuDeviceGetUuid_v2", None) or d.cuDeviceGetUuid
        raw = bytes(self._results.value(get_uuid(self._device), "reading the device UUID").bytes)
        hexed = raw.hex()
        uuid = f"GPU-{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:32]}"
        version = int(self._results.value(d.cuDriverGetVersion(), "reading the driver version"))
        try:
            major, minor = nvrtc_version()
            compiler = f"nvrtc {major}.{minor}"
        except RuntimeUnavailable:
            compiler = "nvrtc unavailable"
        return DeviceIdentity(
            kind="cuda",
            name=self._name,
            uuid=uuid,
            driver=f"cuda {version // 1000}.{version % 1000 // 10}",
            compiler=compiler,
        )

    # ----- helpers -------------------------------------------------------------------------

    # ----- what the backend is -------------------------------------------------------------

    @property
    def name(self) -> str:
        """The device's name and compute capability."""
        major, minor = self._compute_capability
        return f"{self._name} (sm_{major}{minor})"

    @property
    def idle_markers(self) -> int:
        """Marker events pooled for reuse (a diagnostic: a lost marker never comes back)."""
        return self._device_state.pooled_markers

    @property
    def watched_completions(self) -> int:
        """Completions the reactor's thread still watches (a diagnostic for leaks)."""
        return self._device_state.reactor.watched

    @property
    def dlpack_device(self) -> tuple[int, int]:
        """DLPack's ``(kDLCUDA, the device's ordinal)``."""
        return (2, self._ordinal)

    @property
    def compute_capability(self) -> tuple[int, int]:
        """The device's ``(major, minor)`` compute capability."""
        return self._compute_capability

    @property
    def identity(self) -> DeviceIdentity:
        """The GPU (name, UUID), the driver's CUDA version and NVRTC's."""
        return self._identity

    @property
    def cache_flush_bytes(self) -> int:
        """Twice the device's L2 cache."""
        return 2 * self._l2_bytes

    @property
    def peak_memory_bandwidth(self) -> float | None:
        """Twice the memory clock times the bus width (``None`` if the driver does not say)."""
        d = driver()
        attribute = d.CUdevice_attribute
        try:
            clock_khz = d.cuDeviceGetAttribute(
                attribute.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, self._device
            )
            bus_bits = d.cuDeviceGetAttribute(
                attribute.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, self._device
            )
        except AttributeError:  # an attribute this cuda-bindings does not name
            return None
        if int(clock_khz[0]) or int(bus_bits[0]) or not clock_khz[1] or not bus_bits[1]:
            return None
        return 2.0 * int(clock_khz[1]) * 1e3 * int(bus_bits[1]) / 8

    @property
    def formats(self) -> frozenset[ArtifactFormat]:
        """CUDA source, PTX and cubin."""
        return frozenset(
            {ArtifactFormat.CUDA_SOURCE, ArtifactFormat.CUDA_PTX, ArtifactFormat.CUDA_CUBIN}
        )

    @property
    def preferred_formats(self) -> tuple[ArtifactFormat, ...]:
        """Cubin first (no JIT), then source (compiled for this device), then PTX."""
        return (ArtifactFormat.CUDA_CUBIN, ArtifactFormat.CUDA_SOURCE, ArtifactFormat.CUDA_PTX)

    @property
    def default_stream(self) -> StreamHandle:
        """A non-blocking stream of the backend's own (not the legacy NULL stream)."""
        return self._default_stream

    # ----- buffers -------------------------------------------------------------------------

    def _allocate(self, object_id: int, byte_size: int, alignment: int) -> Any:
        state = self._device_state
        kept = state.blocks.take(byte_size, alignment)
        if kept is not None:
            return kept
        capacity = -(-byte_size // _GRANULE) * _GRANULE
        with state.bound():
            pointer = state.allocate(capacity, f"allocating {capacity} bytes")
            if pointer % alignment:
                self._release_block(Allocation(pointer, pointer, capacity))
                capacity += alignment
                padded = state.allocate(capacity, f"allocating {capacity} bytes")
                return Allocation(padded, padded + (-padded) % alignment, capacity)
        return Allocation(pointer, pointer, capacity)

    def _release_block(self, allocation: Allocation) -> None:
        """Keep ``allocation`` for reuse, or free it on the janitor's thread.

        Memory other libraries were offered (:meth:`mark_shared`) is freed, as
        ``cuMemFree`` waits for their work on it too.
        """
        state = self._device_state
        if allocation.shared or not state.blocks.keep(allocation):
            base = allocation.base
            state.janitor.submit(f"freeing {allocation!r}", lambda: driver().cuMemFree(base))

    def mark_shared(self, buffer: BufferHandle) -> None:
        """Its memory is freed when it is destroyed, never kept for another buffer.

        For buffers other libraries may use on streams of theirs (an
        :class:`~accy_async.arrays.ArrayView` marks its buffer):
        ``cuMemFree`` waits for their work, which this backend cannot see.
        """
        native = buffer.native
        if isinstance(native, Allocation):
            native.shared = True

    async def empty_cache(self) -> int:
        """Free the memory and unload the modules kept for reuse; the bytes freed.

        For other allocators of the process (PyTorch's, CuPy's) that ran out of
        memory. The frees run on a worker thread, after the device's running
        work (:meth:`aclose` does the same).
        """
        await anyio.lowlevel.checkpoint()
        state = self._device_state
        held = state.blocks.held
        bases, shelved = state.blocks.drain(), state.shelf.drain()
        if bases or shelved:
            await anyio.to_thread.run_sync(self._free_kept, bases, shelved)
        return held

    def _free_kept(self, bases: Sequence[int], shelved: Sequence[ShelvedModule]) -> None:
        """Free kept blocks and unload shelved modules (on any thread), failures remembered."""
        d = driver()
        failures = self._device_state.janitor.failures
        with self._device_state.bound():
            quiet_device()
            for base in bases:
                if int(d.cuMemFree(base)[0]):
                    failures.append(f"freeing a kept block at 0x{base:x}")
            for each in shelved:
                if int(unload_shelved(each)[0]):
                    failures.append("unloading a shelved module")

    def _buffer_address(self, native: Any) -> int:
        address: int = native.address
        return address

    def _write(
        self, buffer: BufferHandle, data: memoryview, offset: int, stream: StreamHandle
    ) -> None:
        size = data.nbytes
        state = self._device_state
        host, capacity = state.take_staging(size)
        ctypes.memmove(host, np.frombuffer(data, dtype=np.uint8).ctypes.data, size)
        d = driver()
        try:
            self._results.check(
                d.cuMemcpyHtoDAsync(buffer.address + offset, host, size, stream.native),
                "copying to the device",
            )
        except BaseException:
            state.staging.give_back(host, capacity)  # nothing was queued from it
            raise
        state.ledger(stream).enqueue(self._copy_costs["copy to the device"], size)
        state.stage_until_copied(stream, host, capacity)

    def _copy(
        self,
        source: BufferHandle,
        source_offset: int,
        destination: BufferHandle,
        destination_offset: int,
        size: int,
        stream: StreamHandle,
    ) -> None:
        self._results.check(
            driver().cuMemcpyDtoDAsync(
                destination.address + destination_offset,
                source.address + source_offset,
                size,
                stream.native,
            ),
            "copying on the device",
        )
        self._device_state.ledger(stream).enqueue(self._copy_costs["copy on the device"], size)

    def _copies_from(self, source_backend: Any) -> bool:
        return isinstance(source_backend, CudaBackend)

    def _copy_from(
        self,
        source_backend: Any,
        source: BufferHandle,
        source_offset: int,
        destination: BufferHandle,
        destination_offset: int,
        size: int,
        after: StreamHandle,
        stream: StreamHandle,
    ) -> None:
        d = driver()
        peer: CudaBackend = source_backend  # copy_from asked _copies_from first
        if after.native is not stream.native:  # ordered after the source's work, on the device
            self._follow_peer(peer, after, stream)
        if peer is not self and int(peer._context) != int(self._context):
            self._enable_peer_access(peer)
        self._results.check(
            d.cuMemcpyPeerAsync(
                destination.address + destination_offset,
                self._context,
                source.address + source_offset,
                peer._context,
                size,
                stream.native,
            ),
            "copying from another device",
        )
        self._device_state.ledger(stream).enqueue(self._copy_costs["copy on the device"], size)

    def _follow_peer(self, peer: Any, after: StreamHandle, stream: StreamHandle) -> None:
        """``stream`` waits, on the device, for the work queued so far on ``peer``'s ``after``.

        A marker of ``peer``'s context is recorded on ``after`` and waited for
        on ``stream`` (a wait takes the record as it is when enqueued, so the
        marker goes straight back to ``peer``'s pool). When ``after``'s work
        ends is ``peer``'s to know: ``stream``'s forecast starts over.
        """
        if not isinstance(peer, CudaBackend):
            super()._follow_peer(peer, after, stream)
            return
        self._order(after.native, stream.native, source=peer)
        if peer is not self:
            self._device_state.ledger(stream).lose_track()

    def _enable_peer_access(self, peer: CudaBackend) -> None:
        """Let this context reach ``peer``'s memory directly, where the devices allow it (once)."""
        key = int(peer._context)
        if key in self._peers:
            return
        d = driver()
        can = int(
            self._results.value(
                d.cuDeviceCanAccessPeer(self._device, peer._device), "asking about peer access"
            )
        )
        if can:
            with self._device_state.bound():
                result = d.cuCtxEnablePeerAccess(peer._context, 0)[0]
            already = d.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            if result != already:
                self._results.check((result,), "enabling peer access")
        self._peers[key] = bool(can)

    def _enqueue_read(
        self, buffer: BufferHandle, offset: int, size: int, stream: StreamHandle
    ) -> PendingRead:
        host, capacity = self._device_state.take_staging(size)
        d = driver()
        try:
            if size:
                self._results.check(
                    d.cuMemcpyDtoHAsync(host, buffer.address + offset, size, stream.native),
                    "copying to the host",
                )
        except BaseException:
            self._device_state.staging.give_back(host, capacity)
            raise
        self._device_state.ledger(stream).enqueue(self._copy_costs["copy to the host"], size)
        try:
            mark = CudaStreamMark(self._device_state, stream)
        except BaseException:
            self._device_state.staging.give_back(
                host, capacity
            )  # the copy failed to enqueue or faulted
            raise
        return CudaRead(self._device_state, host, capacity, size, mark)

    def _fill(self, buffer: BufferHandle, pattern: int, stream: StreamHandle) -> None:
        if buffer.byte_size % 4:
            raise UnsupportedOperation(
                f"a 32-bit fill needs a size that is a multiple of 4, {buffer!r} has "
                f"{buffer.byte_size} bytes"
            )
        d = driver()
        self._results.check(
            d.cuMemsetD32Async(
                buffer.native.address, pattern, buffer.byte_size // 4, stream.native
            ),
            "filling a buffer",
        )
        self._device_state.ledger(stream).enqueue(self._copy_costs["fill"], buffer.byte_size)

    # ----- artifacts -----------------------------------------------------------------------

    async def _create_artifact(self, spec: ArtifactSpec) -> KernelArtifact:
        return await create_artifact(spec, self._compute_capability, self._compile_pool)

    @contextlib.asynccontextmanager
    async def parallel_compilation(self, workers: int) -> AsyncIterator[None]:
        """Compile CUDA C in the shared pool of NVRTC processes within the block.

        The pool (:func:`~accy_async.backends.cuda.nvrtc.shared_compile_pool`) keeps
        its workers after the block, for the next one.
        """
        if self._compile_pool is not None:
            yield
            return
        self._compile_pool = shared_compile_pool(workers)
        try:
            yield
        finally:
            self._compile_pool = None

    async def _load_artifact(self, object_id: int, artifact: KernelArtifact) -> Any:
        state = self._device_state
        return await load_kernel(
            self._context, artifact, state.forecast, state.janitor, state.shelf
        )

    # ----- streams and events --------------------------------------------------------------

    def _create_stream(self, object_id: int) -> Any:
        d = driver()
        with self._device_state.bound():
            native = self._results.value(
                d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "creating a stream"
            )
        self._device_state.track(object_id)
        return native

    def _adopt_stream(self, object_id: int, raw: int) -> Any:
        d = driver()
        native = self._foreign(raw)
        if raw > _PER_THREAD_STREAM:  # a created stream: it must be this backend's device's
            result, context = d.cuStreamGetCtx(native)
            if result != self._device_state.success:
                raise InvalidBuffer(f"0x{raw:x} is not a live CUDA stream", path="$.stream")
            if int(context) != int(self._context):
                raise InvalidBuffer(
                    f"stream 0x{raw:x} belongs to another CUDA context (another device?)",
                    path="$.stream",
                )
        self._device_state.track(object_id)
        return native

    def _forget_stream(self, stream: StreamHandle) -> None:
        self._device_state.ledgers.pop(stream.id, None)

    def _create_event(self, object_id: int, timing: bool) -> Any:
        d = driver()
        flags = d.CUevent_flags.CU_EVENT_DEFAULT if timing else self._device_state.event_flags
        with self._device_state.bound():
            return self._results.value(d.cuEventCreate(flags), "creating an event")

    def _elapsed(self, start: EventHandle, end: EventHandle) -> float:
        d = driver()
        elapsed_time = getattr(d, "cuEventElapsedTime_v2", None) or d.cuEventElapsedTime
        milliseconds = self._results.value(elapsed_time(start.native, end.native), "timing events")
        return float(milliseconds) / 1000.0

    def _trace_stamp(self, stream: StreamHandle, record: TraceRecord, end: bool) -> None:
        """A timing event on ``stream``: the device's time when it reaches this point."""
        tracer = self.tracer
        assert tracer is not None  # stamps come from _traced, which runs only while tracing
        self._device_state.trace_clock.stamp(stream.native, record, end, tracer)

    def _record(self, event: EventHandle, stream: StreamHandle) -> None:
        self._device_state.record(event, stream)

    def anticipate(self, event: EventHandle) -> Anticipation | None:
        """When the work before the record should end: its stream's queued work, simulated.

        See :mod:`accy_async.backends.forecast`; ``None`` while a kernel of
        it was never seen complete, or with ``anticipation=False``.
        """
        record = self._device_state.records.get(event.id)
        if record is None or not self.polled_from_loop:
            return None
        return record.ledger.anticipate(record.position)

    def _follow_foreign(self, stream: StreamHandle, raw: int) -> None:
        self._order(self._foreign(raw), stream.native)
        self._device_state.ledger(
            stream
        ).lose_track()  # when the foreign work ends is not known here

    def _lead_foreign(self, raw: int, stream: StreamHandle) -> None:
        self._order(stream.native, self._foreign(raw))

    @staticmethod
    def _foreign(raw: int) -> Any:
        """The ``CUstream`` of a raw handle (a negative one is refused)."""
        if raw < 0:
            raise InvalidBuffer(f"a raw stream handle is not negative, got {raw}", path="$.stream")
        return driver().CUstream(raw)

    def _order(self, first: Any, then: Any, *, source: CudaBackend | None = None) -> None:
        """``then`` waits for what is queued on ``first`` so far (a pooled marker between).

        ``source`` is the backend ``first`` belongs to where it is another's
        (a peer): the marker is of its context, and a failed record is its fault.
        """
        owner = self if source is None else source
        marker = owner._device_state.take_marker()
        d = driver()
        try:
            owner._results.check(d.cuEventRecord(marker, first), "recording on a foreign stream")
            self._results.check(d.cuStreamWaitEvent(then, marker, 0), "waiting across streams")
        finally:
            # A wait takes the record as it is when enqueued: the marker may be reused.
            owner._device_state.recycle_marker(marker)

    def _wait(self, stream: StreamHandle, event: EventHandle) -> None:
        self._device_state.wait(stream, event)

    # ----- launch --------------------------------------------------------------------------

    def _launch(
        self,
        loaded: LoadedArtifact,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        config: LaunchConfig,
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
        diagnostic_id: str | None,
    ) -> None:
        self._launcher_of(loaded).launch_untraced(
            buffers, scalars, config, stream, wait_events, signal_event
        )

    def stage_launcher(self, loaded: LoadedArtifact) -> StageLauncher:
        """A launcher with the kernel's argument array, packer and driver call bound once."""
        return self._launcher_of(loaded)

    def _launcher_of(self, loaded: LoadedArtifact) -> CudaStageLauncher:
        kernel: Kernel = loaded.native
        if kernel.launcher is None:
            kernel.launcher = CudaStageLauncher(self, loaded, self._device_state, self._health)
        return kernel.launcher

    # ----- graphs --------------------------------------------------------------------------

    async def _prepare_graph_kernels(self, loaded: tuple[LoadedArtifact, ...]) -> None:
        await load_table_variants(self._context, [each.native for each in loaded])

    def _instantiate_graph(self, object_id: int, nodes: tuple[GraphNode, ...]) -> Any:
        return instantiate_graph(self._device_state, nodes)

    def _launch_graph(
        self,
        graph: GraphExec,
        arguments: Sequence[NodeArguments],
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
    ) -> None:
        launch_graph(self._device_state, graph, arguments, stream, wait_events, signal_event)

    def _destroy_graph(self, graph: GraphExec) -> None:
        built = graph.native
        # Safe while a launch of it runs: the driver frees it once the launch completes.
        self._device_state.janitor.submit(f"destroying {graph!r}", lambda: destroy_graph(built))

    # ----- completion ----------------------------------------------------------------------

    def _query_event(self, event: EventHandle) -> bool:
        (result,) = driver().cuEventQuery(event.native)
        if result == self._device_state.success:
            record = self._device_state.records.get(event.id)
            if record is not None and not record.seen:
                record.seen = True
                record.ledger.sighted(record.position, record.pending_at, time.perf_counter())
            return True
        if result != self._device_state.not_ready:
            self._results.fail(result, "querying an event")
        record = self._device_state.records.get(event.id)
        if record is not None:
            record.pending_at = time.perf_counter()
        return False

    def _query_stream(self, stream: StreamHandle) -> bool:
        (result,) = driver().cuStreamQuery(stream.native)
        if result == self._device_state.success:
            return True
        if result != self._device_state.not_ready:
            self._results.fail(result, "querying a stream")
        return False

    def _notify_when_complete(
        self, event: EventHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        record = self._device_state.records.get(event.id)
        if record is None:  # never recorded: complete
            callback(None)
            return ALREADY_FIRED
        watched = record.watched
        if watched is None:  # one reactor watch per record, however many wait for it
            watched = record.watched = Completion()
            watched.register(record.sighted)
            self._device_state.reactor.watch(event.native, record.stream, watched)
        return watched.register(callback)

    def _mark_stream(self, stream: StreamHandle) -> StreamMark:
        """A pooled marker recorded on ``stream``, watched like an event (anticipated too)."""
        return CudaStreamMark(self._device_state, stream)

    def _notify_when_stream_complete(
        self, stream: StreamHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        mark = CudaStreamMark(self._device_state, stream)
        registration = mark.notify_when_complete(callback)
        mark.release()
        return registration

    # ----- destruction ---------------------------------------------------------------------

    def _destroy(self, obj: DeviceObject) -> None:
        d = driver()
        state = self._device_state
        if isinstance(obj, BufferHandle):
            self._release_block(obj.native)
        elif isinstance(obj, LoadedArtifact):
            for shelved in shelve_kernel(obj.native, state.shelf):
                state.janitor.submit(
                    f"unloading a module of {obj!r}'s image", partial(unload_shelved, shelved)
                )
        elif isinstance(obj, EventHandle):
            # Safe while the event is pending: the driver releases it once it completes.
            state.records.pop(obj.id, None)
            d.cuEventDestroy(obj.native)
        elif isinstance(obj, StreamHandle):
            state.ledgers.pop(obj.id, None)
            d.cuStreamDestroy(obj.native)

    async def _drain(self) -> None:
        if self.fault is not None:
            return
        context = self._context

        def synchronize() -> None:
            driver().cuCtxSetCurrent(context)
            quiet_device()

        await anyio.to_thread.run_sync(synchronize)

    def _close(self) -> None:
        d = driver()
        # Before the janitor stops: a block the pool has no room for is freed on its thread.
        self._device_state.release_staged()
        self._device_state.reactor.close()
        self._device_state.janitor.close()
        # What was kept for reuse goes now (aclose drained the device, unless it faulted).
        self._free_kept(self._device_state.blocks.drain(), self._device_state.shelf.drain())
        if self._device_state.janitor.failures:
            warnings.warn(
                f"accy-async: {len(self._device_state.janitor.failures)} CUDA releases failed: "
                f"{self._device_state.janitor.failures[:4]}",
                ResourceWarning,
                stacklevel=3,
            )
        self._device_state.staging.release_all()
        self._device_state.trace_clock.close()
        d.cuStreamDestroy(self._default_native)
        self._device_state.destroy_markers()
        d.cuDevicePrimaryCtxRelease(self._device)

    def _on_poisoned(self, fault: DeviceFault) -> None:
        self._device_state.reactor.fail_all(fault)
