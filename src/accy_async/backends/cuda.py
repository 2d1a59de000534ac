"""The CUDA backend: an NVIDIA GPU through cuda-python's driver API and NVRTC.

* **Device and context**: device ``device`` (0 by default) and its primary
  context, made current on the thread that opens the backend (use the backend
  from that thread: the event loop's) and on the backend's own threads.
* **Buffers**: ``cuMemAlloc`` (256-byte aligned or better); copies through
  pinned staging memory (``cuMemHostAlloc``, pooled) so that host-to-device
  and device-to-host copies are truly asynchronous in stream order; 32-bit
  fills with ``cuMemsetD32Async``. Frees that may synchronize the device
  (``cuMemFree``, ``cuModuleUnload``, ``cuMemFreeHost``) run on a janitor
  thread, never on the event loop's.
* **Artifacts**: CUDA C++ compiled by NVRTC to a cubin for the device (PTX as
  the fallback), or PTX or cubin payloads; compiling and loading run in worker
  threads. Each loaded kernel keeps one packed argument array (a ``void*``
  array over an 8-byte slot per argument) that every launch refills in place.
* **Streams and events**: non-blocking streams; events without timing (the
  backend's own completion markers pooled); device-side waits with
  ``cuStreamWaitEvent``; non-blocking queries.
* **Completion**: a :class:`~accy_async.backends.cuda_reactor.CompletionReactor`.
* **Faults**: every ``CUresult`` is translated; sticky ones poison the backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import queue
import struct
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any, Final

import anyio.to_thread
import numpy as np

from ..errors import (
    DeviceFault,
    InvalidArtifact,
    InvalidBuffer,
    RuntimeUnavailable,
    UnsupportedOperation,
)
from ..plan import ArtifactFormat, ArtifactSpec, BinaryPayload, ScalarArgument, TextPayload
from ._completion import ALREADY_FIRED, Completion
from .base import (
    DEFAULT_STREAM_ID,
    Anticipation,
    Backend,
    BufferBinding,
    BufferHandle,
    CompletionCallback,
    CompletionRegistration,
    DeviceIdentity,
    DeviceObject,
    EventHandle,
    KernelArtifact,
    Limits,
    LoadedArtifact,
    PendingRead,
    StageLauncher,
    StreamHandle,
    StreamMark,
    WaitPolicy,
)
from .compile_pool import CompilePool, shared_compile_pool
from .cuda_driver import driver, initialised_driver, probe_cuda, translate
from .cuda_reactor import CompletionReactor
from .forecast import CostModel, Forecast, Ledger, byte_features
from .nvrtc import compile_source, nvrtc_version

__all__ = ["CudaBackend", "probe_cuda"]

_SCALAR_CODES: Final = {
    "u32": "I4x",
    "i32": "i4x",
    "f32": "f4x",
    "u64": "Q",
    "i64": "q",
    "f64": "d",
}
_PER_THREAD_STREAM: Final = 2
"""CU_STREAM_PER_THREAD; 0 and 1 are the NULL and legacy streams: handles of no context."""

_STAGING_POOL_BYTES: Final = 256 * 1024 * 1024
_MIN_STAGING: Final = 4096


class _Kernel:
    """A loaded function with its reusable argument array."""

    __slots__ = (
        "argument_count",
        "cost",
        "formats",
        "function",
        "launcher",
        "module",
        "params",
        "pointers",
        "slots",
    )

    def __init__(self, module: Any, function: Any, argument_count: int, cost: CostModel) -> None:
        self.cost = cost
        """What the forecast learns of this kernel's length (shared by every load of its image)."""
        self.module = module
        self.function = function
        self.argument_count = argument_count
        count = max(argument_count, 1)
        self.slots = ctypes.create_string_buffer(8 * count)
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
        self.params = ctypes.addressof(self.pointers)
        self.formats: dict[tuple[str, ...], struct.Struct] = {}
        self.launcher: _CudaStageLauncher | None = None

    def packer(self, buffer_count: int, scalar_types: tuple[str, ...]) -> struct.Struct:
        packer = self.formats.get(scalar_types)
        if packer is None:
            codes = "".join(_SCALAR_CODES[t] for t in scalar_types)
            packer = self.formats[scalar_types] = struct.Struct("<" + "Q" * buffer_count + codes)
        return packer


class _Staging:
    """Pinned host memory, pooled by power-of-two size class."""

    def __init__(self, janitor: _Janitor) -> None:
        self._janitor = janitor
        self._free: dict[int, list[int]] = {}
        self._pooled = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> tuple[int, int]:
        capacity = max(_MIN_STAGING, 1 << (max(size, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(capacity)
            if free:
                self._pooled -= capacity
                return free.pop(), capacity
        d = driver()
        result, pointer = d.cuMemHostAlloc(capacity, 0)
        if int(result):
            raise translate(result, f"allocating {capacity} bytes of pinned memory")
        return int(pointer), capacity

    def give_back(self, pointer: int, capacity: int) -> None:
        with self._lock:
            if self._pooled + capacity <= _STAGING_POOL_BYTES:
                self._free.setdefault(capacity, []).append(pointer)
                self._pooled += capacity
                return
        self._janitor.submit("freeing pinned memory", lambda: driver().cuMemFreeHost(pointer))

    def release_all(self) -> None:
        with self._lock:
            pointers = [p for free in self._free.values() for p in free]
            self._free.clear()
            self._pooled = 0
        d = driver()
        for pointer in pointers:
            d.cuMemFreeHost(pointer)


class _Janitor:
    """A thread for driver calls that may synchronize the device (frees, unloads).

    Failures are remembered, not raised: the backend reports them as a
    :class:`ResourceWarning` when it closes (a failed free is a leak).
    """

    def __init__(self, context: Any) -> None:
        self._context = context
        self._queue: queue.SimpleQueue[tuple[str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run, name="accy-cuda-janitor", daemon=True)
        self._thread.start()

    def submit(self, what: str, work: Callable[[], Any]) -> None:
        self._queue.put((what, work))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        driver().cuCtxSetCurrent(self._context)
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, work = item
            try:
                result = work()
            except Exception as exc:  # noqa: BLE001 - recorded and reported at close
                self.failures.append(f"{what}: {exc}")
                continue
            if isinstance(result, tuple) and result and int(result[0]):
                self.failures.append(f"{what}: {translate(result[0], what)}")


class _CudaStreamMark(Completion, StreamMark):
    """A pooled marker event recorded on a stream: a position in the stream's ledger.

    It fires (as a :class:`Completion`) when a query from the loop sees the
    marker complete, or when the reactor does once someone asked to be
    called back; either sighting teaches the forecast.
    """

    __slots__ = (
        "_backend",
        "_ledger",
        "_marker",
        "_pending_at",
        "_position",
        "_stream",
        "_watched",
    )

    def __init__(self, backend: CudaBackend, stream: StreamHandle) -> None:
        super().__init__()
        marker = backend._marker()
        (result,) = driver().cuEventRecord(marker, stream.native)
        if int(result):
            backend._recycle_marker(marker)
            backend._raise(result, "recording a marker")
        ledger = backend._ledger(stream)
        self._backend = backend
        self._marker = marker
        self._stream = stream.native
        self._ledger = ledger
        self._position = ledger.position
        self._pending_at: float | None = None
        self._watched = False

    @property
    def backend(self) -> CudaBackend:
        """The backend whose stream was marked."""
        return self._backend

    def query(self) -> bool:
        backend = self._backend
        if backend._unusable is not None:
            backend._raise_unusable()
        if self.done:
            return True
        (result,) = driver().cuEventQuery(self._marker)
        now = time.perf_counter()
        if result == backend._success:
            self._ledger.sighted(self._position, self._pending_at, now)
            self(None)
            return True
        if result == backend._not_ready:
            self._pending_at = now
            return False
        backend._raise(result, "querying a stream")
        return False

    def anticipate(self) -> Anticipation | None:
        if not self._backend.polled_from_loop:
            return None
        return self._ledger.anticipate(self._position)

    def notify_when_complete(self, callback: CompletionCallback) -> CompletionRegistration:
        self.watch()
        return self.register(callback)

    def watch(self) -> None:
        """Have the reactor fire this mark (once, however often it is asked)."""
        if self._watched or self.done:
            return
        self._watched = True
        self.register(self._sighted)
        self._backend._reactor.watch(self._marker, self._stream, self)

    def _sighted(self, error: BaseException | None) -> None:
        """On the reactor's thread: tell the ledger (a late sighting, at best a bracket)."""
        if error is None:
            self._ledger.sighted(self._position, self._pending_at, time.perf_counter())

    def release(self) -> None:
        backend, marker = self._backend, self._marker
        if backend.closed:
            return  # the context took the marker with it
        # Recycle the marker once the device is past it: at once if it was seen complete,
        # else when the reactor sees it (at once after a fault: it fails every watch then).
        self.watch()
        self.register(lambda error: backend._recycle_marker(marker))


class _CudaRead(PendingRead):
    """A device-to-host copy into pinned staging memory, followed by a stream mark.

    The staging block goes back to the pool only once the copy has landed,
    also when the read is discarded while the copy is still in flight.
    """

    __slots__ = ("_backend", "_capacity", "_done", "_host", "_mark", "_size")

    def __init__(
        self, backend: CudaBackend, host: int, capacity: int, size: int, mark: _CudaStreamMark
    ) -> None:
        self._backend = backend
        self._host = host
        self._capacity = capacity
        self._size = size
        self._mark = mark
        self._done = False

    def stream_mark(self) -> StreamMark:
        return self._mark

    def notify_when_complete(self, callback: CompletionCallback) -> CompletionRegistration:
        return self._mark.notify_when_complete(callback)

    def result(self) -> memoryview:
        data = memoryview(ctypes.string_at(self._host, self._size))
        self.discard()
        return data

    def discard(self) -> None:
        if self._done:
            return
        self._done = True
        give_back = partial(self._backend._staging.give_back, self._host, self._capacity)
        mark = self._mark
        if mark.done or self._backend.fault is not None:
            give_back()
        else:  # the copy may still be landing there: give the block back once it has
            mark.watch()
            mark.register(lambda error: give_back())
        mark.release()


class _Record:
    """An event's latest record: where it sits in its stream's ledger, and what was seen."""

    __slots__ = ("ledger", "pending_at", "position", "seen", "stream", "watched")

    def __init__(self, stream: Any, ledger: Ledger) -> None:
        self.stream = stream
        self.ledger = ledger
        self.position = ledger.position
        self.pending_at: float | None = None
        self.seen = False
        self.watched: Completion | None = None

    def sighted(self, error: BaseException | None) -> None:
        """On the reactor's thread: tell the ledger (a late sighting, at best a bracket)."""
        if error is None and not self.seen:
            self.ledger.sighted(self.position, self.pending_at, time.perf_counter())


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
    ) -> None:
        super().__init__(limits=limits, wait_policy=wait_policy)
        self.polled_from_loop = anticipation
        self._compile_pool: CompilePool | None = None
        self._forecast = Forecast()
        self._ledgers: dict[int, Ledger] = {DEFAULT_STREAM_ID: Ledger(self._forecast)}
        self._records: dict[int, _Record] = {}
        self._copy_costs = {
            kind: self._forecast.model(kind, kind, byte_features)
            for kind in ("copy to the device", "copy to the host", "copy on the device", "fill")
        }
        d = initialised_driver()
        self._device = self._value(d.cuDeviceGet(device), f"opening device {device}")
        self._ordinal = device
        raw = self._value(d.cuDeviceGetName(256, self._device), "reading the device name")
        self._name = raw.split(b"\0", 1)[0].decode(errors="replace")
        attribute = d.CUdevice_attribute
        self._compute_capability = (
            int(
                self._value(
                    d.cuDeviceGetAttribute(
                        attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._device
                    ),
                    "cc",
                )
            ),
            int(
                self._value(
                    d.cuDeviceGetAttribute(
                        attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._device
                    ),
                    "cc",
                )
            ),
        )
        self._l2_bytes = int(
            self._value(
                d.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, self._device),
                "reading the L2 cache size",
            )
        )
        self._identity = self._read_identity()
        total = int(self._value(d.cuDeviceTotalMem(self._device), "reading the memory size"))
        if limits is None:
            self.limits = Limits(max_buffer_bytes=total, max_total_bytes=total)
        self._context = self._value(
            d.cuDevicePrimaryCtxRetain(self._device), "retaining the primary context"
        )
        self._check(d.cuCtxSetCurrent(self._context), "making the context current")
        self._default_native = self._value(
            d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "creating a stream"
        )
        self._default_stream = StreamHandle(
            self.backend_id, DEFAULT_STREAM_ID, self._default_native
        )
        self._marker_pool: list[Any] = []
        self._marker_pool_lock = threading.Lock()
        self._janitor = _Janitor(self._context)
        self._staging = _Staging(self._janitor)
        self._reactor = CompletionReactor(self._context, self.poison, poll_interval=poll_interval)
        self._event_flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._success = d.CUresult.CUDA_SUCCESS
        self._not_ready = d.CUresult.CUDA_ERROR_NOT_READY
        self._launch_kernel = d.cuLaunchKernel

    def _read_identity(self) -> DeviceIdentity:
        d = driver()
        get_uuid = getattr(d, "cuDeviceGetUuid_v2", None) or d.cuDeviceGetUuid
        raw = bytes(self._value(get_uuid(self._device), "reading the device UUID").bytes)
        hexed = raw.hex()
        uuid = f"GPU-{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:32]}"
        version = int(self._value(d.cuDriverGetVersion(), "reading the driver version"))
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

    def _check(self, result: Any, action: str) -> None:
        code = result[0] if isinstance(result, tuple) else result
        if int(code):
            self._raise(code, action)

    def _value(self, result: tuple[Any, ...], action: str) -> Any:
        if int(result[0]):
            self._raise(result[0], action)
        return result[1]

    def _raise(self, code: Any, action: str) -> None:
        error = translate(code, action)
        if isinstance(error, DeviceFault):
            self.poison(error)
        raise error

    def _ledger(self, stream: StreamHandle) -> Ledger:
        """The forecast's ledger of ``stream``'s work."""
        return self._ledgers[stream.id]

    def _marker(self) -> Any:
        """A pooled event for the backend's own completion markers."""
        with self._marker_pool_lock:
            if self._marker_pool:
                return self._marker_pool.pop()
        return self._create_event(0, False)

    def _recycle_marker(self, native: Any) -> None:
        with self._marker_pool_lock:
            if len(self._marker_pool) < 1024:
                self._marker_pool.append(native)
                return
        driver().cuEventDestroy(native)

    # ----- what the backend is -------------------------------------------------------------

    @property
    def name(self) -> str:
        """The device's name and compute capability."""
        major, minor = self._compute_capability
        return f"{self._name} (sm_{major}{minor})"

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
        d = driver()
        pointer = int(self._value(d.cuMemAlloc(byte_size), f"allocating {byte_size} bytes"))
        if pointer % alignment:
            self._janitor.submit("freeing a misaligned buffer", lambda: d.cuMemFree(pointer))
            padded = int(
                self._value(d.cuMemAlloc(byte_size + alignment), f"allocating {byte_size} bytes")
            )
            return _Allocation(padded, padded + (-padded) % alignment)
        return _Allocation(pointer, pointer)

    def _buffer_address(self, native: Any) -> int:
        address: int = native.address
        return address

    def _write(
        self, buffer: BufferHandle, data: memoryview, offset: int, stream: StreamHandle
    ) -> None:
        size = data.nbytes
        host, capacity = self._staging.take(size)
        ctypes.memmove(host, np.frombuffer(data, dtype=np.uint8).ctypes.data, size)
        d = driver()
        self._check(
            d.cuMemcpyHtoDAsync(buffer.address + offset, host, size, stream.native),
            "copying to the device",
        )
        self._ledger(stream).enqueue(self._copy_costs["copy to the device"], size)
        self._notify_when_stream_complete(
            stream, lambda error: self._staging.give_back(host, capacity)
        )

    def _copy(
        self,
        source: BufferHandle,
        source_offset: int,
        destination: BufferHandle,
        destination_offset: int,
        size: int,
        stream: StreamHandle,
    ) -> None:
        self._check(
            driver().cuMemcpyDtoDAsync(
                destination.address + destination_offset,
                source.address + source_offset,
                size,
                stream.native,
            ),
            "copying on the device",
        )
        self._ledger(stream).enqueue(self._copy_costs["copy on the device"], size)

    def _enqueue_read(
        self, buffer: BufferHandle, offset: int, size: int, stream: StreamHandle
    ) -> PendingRead:
        host, capacity = self._staging.take(size)
        d = driver()
        try:
            if size:
                self._check(
                    d.cuMemcpyDtoHAsync(host, buffer.address + offset, size, stream.native),
                    "copying to the host",
                )
        except BaseException:
            self._staging.give_back(host, capacity)
            raise
        self._ledger(stream).enqueue(self._copy_costs["copy to the host"], size)
        try:
            mark = _CudaStreamMark(self, stream)
        except BaseException:
            self._staging.give_back(host, capacity)  # the copy failed to enqueue or faulted
            raise
        return _CudaRead(self, host, capacity, size, mark)

    def _fill(self, buffer: BufferHandle, pattern: int, stream: StreamHandle) -> None:
        if buffer.byte_size % 4:
            raise UnsupportedOperation(
                f"a 32-bit fill needs a size that is a multiple of 4, {buffer!r} has "
                f"{buffer.byte_size} bytes"
            )
        d = driver()
        self._check(
            d.cuMemsetD32Async(
                buffer.native.address, pattern, buffer.byte_size // 4, stream.native
            ),
            "filling a buffer",
        )
        self._ledger(stream).enqueue(self._copy_costs["fill"], buffer.byte_size)

    # ----- artifacts -----------------------------------------------------------------------

    async def _create_artifact(self, spec: ArtifactSpec) -> KernelArtifact:
        payload = spec.payload
        if spec.format is ArtifactFormat.CUDA_SOURCE:
            assert isinstance(payload, TextPayload)
            arguments = (
                payload.text,
                spec.kernel_name,
                spec.compile_options,
                self._compute_capability,
            )
            if self._compile_pool is not None:
                compiled = await self._compile_pool.compile(*arguments)
            else:
                # Cancelled, the caller leaves at once; the compile finishes unseen (cached).
                compiled = await anyio.to_thread.run_sync(
                    compile_source, *arguments, abandon_on_cancel=True
                )
            return KernelArtifact(spec, compiled.image, compiled.kind)
        if spec.format is ArtifactFormat.CUDA_PTX:
            assert isinstance(payload, TextPayload)
            return KernelArtifact(spec, payload.text.encode() + b"\0", "ptx")
        assert isinstance(payload, BinaryPayload)
        return KernelArtifact(spec, payload.data, "cubin")

    @contextlib.asynccontextmanager
    async def parallel_compilation(self, workers: int) -> AsyncIterator[None]:
        """Compile CUDA C in the shared pool of NVRTC processes within the block.

        The pool (:func:`~accy_async.backends.nvrtc.shared_compile_pool`) keeps
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
        context = self._context
        name = artifact.spec.kernel_name

        lock = threading.Lock()
        state: dict[str, Any] = {}

        def load() -> tuple[Any, Any]:
            d = driver()
            d.cuCtxSetCurrent(context)
            result, module = d.cuModuleLoadData(artifact.image)
            if int(result):
                raise translate(result, f"loading {name} ({artifact.image_format})")
            result, function = d.cuModuleGetFunction(module, name.encode())
            if int(result):
                d.cuModuleUnload(module)
                raise InvalidArtifact(f"the module has no kernel named {name!r}")
            with lock:
                if state.get("abandoned"):  # the caller was cancelled: nobody will unload it
                    d.cuModuleUnload(module)
                else:
                    state["loaded"] = module
            return module, function

        try:
            module, function = await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
        except BaseException:
            # Cancelled while the worker thread loads: the caller leaves at once, and whichever
            # of the two finishes last unloads the module.
            with lock:
                state["abandoned"] = True
                loaded = state.pop("loaded", None)
            if loaded is not None:
                driver().cuModuleUnload(loaded)
            raise
        image = artifact.image if isinstance(artifact.image, bytes) else bytes(artifact.image)
        key = (name, hashlib.blake2b(image, digest_size=16).digest())
        return _Kernel(
            module, function, artifact.spec.argument_count, self._forecast.model(key, name)
        )

    # ----- streams and events --------------------------------------------------------------

    def _create_stream(self, object_id: int) -> Any:
        d = driver()
        native = self._value(
            d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "creating a stream"
        )
        self._ledgers[object_id] = Ledger(self._forecast)
        return native

    def _adopt_stream(self, object_id: int, raw: int) -> Any:
        d = driver()
        native = self._foreign(raw)
        if raw > _PER_THREAD_STREAM:  # a created stream: it must be this backend's device's
            result, context = d.cuStreamGetCtx(native)
            if result != self._success:
                raise InvalidBuffer(f"0x{raw:x} is not a live CUDA stream", path="$.stream")
            if int(context) != int(self._context):
                raise InvalidBuffer(
                    f"stream 0x{raw:x} belongs to another CUDA context (another device?)",
                    path="$.stream",
                )
        self._ledgers[object_id] = Ledger(self._forecast)
        return native

    def _forget_stream(self, stream: StreamHandle) -> None:
        self._ledgers.pop(stream.id, None)

    def _create_event(self, object_id: int, timing: bool) -> Any:
        d = driver()
        flags = d.CUevent_flags.CU_EVENT_DEFAULT if timing else self._event_flags
        return self._value(d.cuEventCreate(flags), "creating an event")

    def _elapsed(self, start: EventHandle, end: EventHandle) -> float:
        d = driver()
        elapsed_time = getattr(d, "cuEventElapsedTime_v2", None) or d.cuEventElapsedTime
        milliseconds = self._value(elapsed_time(start.native, end.native), "timing events")
        return float(milliseconds) / 1000.0

    def _record(self, event: EventHandle, stream: StreamHandle) -> None:
        self._check(driver().cuEventRecord(event.native, stream.native), "recording an event")
        self._records[event.id] = _Record(stream.native, self._ledger(stream))

    def anticipate(self, event: EventHandle) -> Anticipation | None:
        """When the work before the record should end: its stream's queued work, simulated.

        See :mod:`accy_async.backends.forecast`; ``None`` while a kernel of
        it was never seen complete, or with ``anticipation=False``.
        """
        record = self._records.get(event.id)
        if record is None or not self.polled_from_loop:
            return None
        return record.ledger.anticipate(record.position)

    def _follow_foreign(self, stream: StreamHandle, raw: int) -> None:
        self._order(self._foreign(raw), stream.native)
        self._ledger(stream).lose_track()  # when the foreign work ends is not known here

    def _lead_foreign(self, raw: int, stream: StreamHandle) -> None:
        self._order(stream.native, self._foreign(raw))

    @staticmethod
    def _foreign(raw: int) -> Any:
        """The ``CUstream`` of a raw handle (a negative one is refused)."""
        if raw < 0:
            raise InvalidBuffer(f"a raw stream handle is not negative, got {raw}", path="$.stream")
        return driver().CUstream(raw)

    def _order(self, first: Any, then: Any) -> None:
        """``then`` waits for what is queued on ``first`` so far (a pooled marker between)."""
        marker = self._marker()
        d = driver()
        try:
            self._check(d.cuEventRecord(marker, first), "recording on a foreign stream")
            self._check(d.cuStreamWaitEvent(then, marker, 0), "waiting across streams")
        finally:
            # A wait takes the record as it is when enqueued: the marker may be reused.
            self._recycle_marker(marker)

    def _wait(self, stream: StreamHandle, event: EventHandle) -> None:
        self._check(
            driver().cuStreamWaitEvent(stream.native, event.native, 0), "waiting for an event"
        )
        record = self._records.get(event.id)
        if record is not None:
            self._ledger(stream).enqueue_wait(record.ledger, record.position)

    # ----- launch --------------------------------------------------------------------------

    def _launch(
        self,
        loaded: LoadedArtifact,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_memory_bytes: int,
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
        diagnostic_id: str | None,
    ) -> None:
        self._launcher_of(loaded)(
            buffers, scalars, grid, block, shared_memory_bytes, stream, wait_events, signal_event
        )

    def stage_launcher(self, loaded: LoadedArtifact) -> StageLauncher:
        """A launcher with the kernel's argument array, packer and driver call bound once."""
        return self._launcher_of(loaded)

    def _launcher_of(self, loaded: LoadedArtifact) -> _CudaStageLauncher:
        kernel: _Kernel = loaded.native
        if kernel.launcher is None:
            kernel.launcher = _CudaStageLauncher(self, loaded)
        return kernel.launcher

    # ----- completion ----------------------------------------------------------------------

    def _query_event(self, event: EventHandle) -> bool:
        (result,) = driver().cuEventQuery(event.native)
        if result == self._success:
            record = self._records.get(event.id)
            if record is not None and not record.seen:
                record.seen = True
                record.ledger.sighted(record.position, record.pending_at, time.perf_counter())
            return True
        if result == self._not_ready:
            record = self._records.get(event.id)
            if record is not None:
                record.pending_at = time.perf_counter()
            return False
        self._raise(result, "querying an event")
        return False

    def _query_stream(self, stream: StreamHandle) -> bool:
        (result,) = driver().cuStreamQuery(stream.native)
        if result == self._success:
            return True
        if result == self._not_ready:
            return False
        self._raise(result, "querying a stream")
        return False

    def _notify_when_complete(
        self, event: EventHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        record = self._records.get(event.id)
        if record is None:  # never recorded: complete
            callback(None)
            return ALREADY_FIRED
        watched = record.watched
        if watched is None:  # one reactor watch per record, however many wait for it
            watched = record.watched = Completion()
            watched.register(record.sighted)
            self._reactor.watch(event.native, record.stream, watched)
        return watched.register(callback)

    def _mark_stream(self, stream: StreamHandle) -> StreamMark:
        """A pooled marker recorded on ``stream``, watched like an event (anticipated too)."""
        return _CudaStreamMark(self, stream)

    def _notify_when_stream_complete(
        self, stream: StreamHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        mark = _CudaStreamMark(self, stream)
        registration = mark.notify_when_complete(callback)
        mark.release()
        return registration

    # ----- destruction ---------------------------------------------------------------------

    def _destroy(self, obj: DeviceObject) -> None:
        d = driver()
        if isinstance(obj, BufferHandle):
            pointer = obj.native.base
            self._janitor.submit(f"freeing {obj!r}", lambda: d.cuMemFree(pointer))
        elif isinstance(obj, LoadedArtifact):
            module = obj.native.module
            self._janitor.submit(f"unloading {obj!r}", lambda: d.cuModuleUnload(module))
        elif isinstance(obj, EventHandle):
            # Safe while the event is pending: the driver releases it once it completes.
            self._records.pop(obj.id, None)
            d.cuEventDestroy(obj.native)
        elif isinstance(obj, StreamHandle):
            self._ledgers.pop(obj.id, None)
            d.cuStreamDestroy(obj.native)

    async def _drain(self) -> None:
        if self._fault is not None:
            return
        context = self._context

        def synchronize() -> None:
            d = driver()
            d.cuCtxSetCurrent(context)
            d.cuCtxSynchronize()

        await anyio.to_thread.run_sync(synchronize)

    def _close(self) -> None:
        d = driver()
        self._reactor.close()
        self._janitor.close()
        if self._janitor.failures:
            warnings.warn(
                f"accy-async: {len(self._janitor.failures)} CUDA releases failed: "
                f"{self._janitor.failures[:4]}",
                ResourceWarning,
                stacklevel=3,
            )
        self._staging.release_all()
        d.cuStreamDestroy(self._default_native)
        with self._marker_pool_lock:
            markers, self._marker_pool = self._marker_pool, []
        for marker in markers:
            d.cuEventDestroy(marker)
        d.cuDevicePrimaryCtxRelease(self._device)

    def _on_poisoned(self, fault: DeviceFault) -> None:
        self._reactor.fail_all(fault)


class _CudaStageLauncher(StageLauncher):
    """Packs arguments straight into the kernel's argument array and calls the driver.

    It remembers the last ``scalars`` object it saw, so a stage launched again
    with the same resolved scalars only packs buffer addresses; prepared
    arguments are the packed bytes themselves, copied in with one assignment.
    """

    __slots__ = ("_cuda", "_kernel", "_launch", "_name", "_state")

    def __init__(self, backend: CudaBackend, loaded: LoadedArtifact) -> None:
        super().__init__(backend, loaded)
        self._cuda = backend
        self._kernel: _Kernel = loaded.native
        self._launch = backend._launch_kernel
        self._name = loaded.artifact.spec.kernel_name
        self._state: list[Any] = [None, (), None]  # last scalars, their values, their packer

    def _pack_for(self, buffer_count: int, scalars: Sequence[ScalarArgument]) -> struct.Struct:
        state = self._state
        if scalars is not state[0]:
            state[0] = scalars
            state[1] = tuple([argument.value for argument in scalars])
            state[2] = self._kernel.packer(
                buffer_count, tuple([argument.type_name for argument in scalars])
            )
        packer: struct.Struct = state[2]
        return packer

    def __call__(
        self,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_memory_bytes: int,
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
    ) -> None:
        """Enqueue one launch of the bound kernel."""
        kernel = self._kernel
        state = self._state
        self._pack_for(len(buffers), scalars).pack_into(
            kernel.slots, 0, *[binding.address for binding in buffers], *state[1]
        )
        self.launch_prepared(
            (kernel.params, None, None, state[1]),
            grid,
            block,
            shared_memory_bytes,
            stream,
            wait_events,
            signal_event,
        )

    def prepare(self, buffers: Sequence[BufferBinding], scalars: Sequence[ScalarArgument]) -> Any:
        """Argument storage of its own, and the scalar values (the forecast sizes launches by them).

        A tuple: the ``void*`` array's address, the packed slots, the array, the values.
        """
        count = max(len(buffers) + len(scalars), 1)
        packer = self._kernel.packer(
            len(buffers), tuple([argument.type_name for argument in scalars])
        )
        values = tuple([argument.value for argument in scalars])
        slots = ctypes.create_string_buffer(
            packer.pack(*[binding.address for binding in buffers], *values), 8 * count
        )
        base = ctypes.addressof(slots)
        pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
        return (ctypes.addressof(pointers), slots, pointers, values)

    def launch_prepared(
        self,
        prepared: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_memory_bytes: int,
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
    ) -> None:
        """Launch with the prepared argument array: nothing is packed or copied."""
        backend = self._cuda
        if backend._unusable is not None:
            backend._raise_unusable()
        if stream is None:
            stream = backend._default_stream
        if wait_events:
            for event in wait_events:
                backend._wait(stream, event)
        kernel = self._kernel
        (result,) = self._launch(
            kernel.function,
            grid[0],
            grid[1],
            grid[2],
            block[0],
            block[1],
            block[2],
            shared_memory_bytes,
            stream.native,
            prepared[0],
            0,
        )
        if result:
            backend._raise(result, f"launching {self._name}")
        backend._ledgers[stream.id].enqueue(kernel.cost, (grid, block, prepared[3]))
        if signal_event is not None:
            backend._record(signal_event, stream)


class _Allocation:
    """A device allocation: ``base`` to free, ``address`` (aligned) to use."""

    __slots__ = ("address", "base")

    def __init__(self, base: int, address: int) -> None:
        self.base = base
        self.address = address

    def __int__(self) -> int:
        return self.address

    def __repr__(self) -> str:
        return f"<device allocation 0x{self.address:x}>"
