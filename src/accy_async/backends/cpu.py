"""The CPU backend: the embedded default, which really executes kernels.

Every stream is a worker thread that runs its queue in order: launches (CPU
kernels over NumPy arrays), copies, fills, event records, and device-side
waits, which block that worker, and only it, until the awaited record has
completed. Events complete when the work queued before them has run, and their
callbacks fire from the worker thread. Buffers are aligned host memory. The
calling thread never blocks on queued work.

A kernel that raises is a device fault: the backend is poisoned with
:class:`~accy_async.errors.DeviceFault`, every waiter fails with it, queued work
is dropped, and new work is refused.
"""

from __future__ import annotations

import os
import platform
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final, NamedTuple

import anyio.to_thread
import numpy as np

from ..errors import DeviceFault, InvalidArtifact, OutOfDeviceMemory, UnsupportedOperation
from ..plan import ArtifactFormat, ArtifactSpec, CpuKernelPayload, ScalarArgument
from ._completion import ALREADY_FIRED, Completion, CompletionCallback, CompletionRegistration
from ._device_info import DeviceIdentity, Limits, WaitPolicy
from ._handles import (
    DEFAULT_STREAM_ID,
    BufferBinding,
    BufferHandle,
    DeviceObject,
    EventHandle,
    KernelArtifact,
    LoadedArtifact,
    StreamHandle,
)
from ._launch_config import LaunchConfig
from ._marks import PendingRead
from ._trace import Tracer, TraceRecord
from .base import Backend
from .cpu_kernels import CpuLaunchContext, describe, lookup_cpu_kernel, parse_defines

__all__ = ["CpuBackend", "host_memory_available"]

_STOP: Final = object()
_YIELD_EVERY: Final = 8
_INLINE_BYTES: Final = 1 << 16
"""A read or write at most this large on an idle stream is copied on the caller's thread:
the round trip to the stream's thread and back costs more than the copy."""


class _CpuImage(NamedTuple):
    """A created CPU artifact: the registered function and its defines."""

    function: Callable[..., None]
    defines: Mapping[str, str]


_NEVER_RECORDED: Final = Completion()
_NEVER_RECORDED()  # an event never recorded counts as complete


class _CpuEvent:
    """An event: the completion of its latest record, and when that record ran.

    ``completed_at`` is when (``time.perf_counter()``) the latest record of a
    timing event ran on its worker thread, for :meth:`CpuBackend.elapsed_seconds`.
    ``condition`` wakes workers waiting for a record on the device side.
    """

    __slots__ = ("completed_at", "condition", "latest")

    def __init__(self) -> None:
        self.condition = threading.Condition(threading.Lock())
        self.latest = _NEVER_RECORDED
        self.completed_at = 0.0


class _Worker:
    """A stream: one thread running its queue in order.

    Only the backend's caller enqueues (``enqueued``) and only the thread
    finishes (``finished``), so comparing the two never needs a lock. An
    operation may return a callable: it runs after ``finished`` counts the
    operation, so whoever it wakes sees the stream's progress; ``settled``
    counts the operation once that callable has run too (an event recorded, a
    read filled).
    """

    __slots__ = ("enqueued", "finished", "queue", "settled", "thread")

    def __init__(self, name: str) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.enqueued = 0
        self.finished = 0
        self.settled = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, operation: Callable[[], Callable[[], None] | None]) -> None:
        self.enqueued += 1
        self.queue.put(operation)

    def idle(self) -> bool:
        return self.finished == self.enqueued

    def settled_all(self) -> bool:
        """Whether everything enqueued has run, its completions fired (events, reads) too."""
        return self.settled == self.enqueued

    def stop(self) -> None:
        self.queue.put(_STOP)

    def _run(self) -> None:
        operations = self.queue
        while True:
            operation = operations.get()
            if operation is _STOP:
                return
            then = operation()
            self.finished += 1
            if then is not None:
                then()
            self.settled += 1
            if not self.finished % _YIELD_EVERY:
                # Let other threads (the event loop above all) take the GIL between
                # long runs of small operations, such as thousands of event records.
                time.sleep(0)


class _CpuRead(PendingRead):
    __slots__ = ("_completion", "_data")

    def __init__(self) -> None:
        self._completion = Completion()
        self._data: memoryview | None = None

    def finish(self, data: memoryview | None, error: BaseException | None) -> None:
        self._data = data
        self._completion(error)

    def notify_when_complete(self, callback: CompletionCallback) -> CompletionRegistration:
        return self._completion.register(callback)

    def result(self) -> memoryview:
        error = self._completion.error
        if error is not None:
            raise error
        if self._data is None:
            raise RuntimeError("the read has not completed")
        return self._data

    def discard(self) -> None:
        self._data = None


class _ReadJob:
    """A queued device-to-host copy (one object: a thousand may wait in a queue)."""

    __slots__ = ("_backend", "_offset", "_read", "_size", "_source")

    def __init__(
        self,
        backend: CpuBackend,
        read: _CpuRead,
        source: np.ndarray[Any, np.dtype[np.uint8]],
        offset: int,
        size: int,
    ) -> None:
        self._backend = backend
        self._read = read
        self._source = source
        self._offset = offset
        self._size = size

    def __call__(self) -> Callable[[], None]:
        read, fault = self._read, self._backend.fault
        if fault is not None:
            return lambda: read.finish(None, fault)
        data = memoryview(self._source[self._offset : self._offset + self._size].tobytes())
        return lambda: read.finish(data, None)


class _StreamMarkJob:
    """A queued point in a stream that fires a completion once the work before it ran."""

    __slots__ = ("_backend", "_completion")

    def __init__(self, backend: CpuBackend, completion: Completion) -> None:
        self._backend = backend
        self._completion = completion

    def __call__(self) -> Callable[[], None]:
        completion, error = self._completion, self._backend.fault
        return lambda: completion(error)


def _machine_id() -> str:
    """``/etc/machine-id`` where there is one, else the host name."""
    try:
        with open("/etc/machine-id", encoding="ascii") as file:
            return file.read().strip() or platform.node()
    except OSError:
        return platform.node()


class CpuBackend(Backend):
    """Runs plans on the CPU, a worker thread per stream; see the module docstring."""

    kind = "cpu"

    def __init__(
        self, *, limits: Limits | None = None, wait_policy: WaitPolicy = "balanced"
    ) -> None:
        super().__init__(limits=limits, wait_policy=wait_policy)
        self._events: dict[int, _CpuEvent] = {}
        self._workers: dict[int, _Worker] = {}
        default_id = DEFAULT_STREAM_ID
        self._workers[default_id] = _Worker(f"accy-cpu-{self.backend_id}-stream-default")
        self._default_stream = StreamHandle(self.backend_id, default_id, self._workers[default_id])

    # ----- Backend -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The device's name."""
        return f"CPU ({os.cpu_count() or 1} cores, NumPy {np.__version__})"

    @property
    def identity(self) -> DeviceIdentity:
        """The machine's processor, NumPy and Python."""
        return DeviceIdentity(
            kind="cpu",
            name=f"{platform.machine()} {platform.processor() or '?'} x{os.cpu_count() or 1}",
            uuid=_machine_id(),
            driver=f"numpy {np.__version__}",
            compiler=f"{platform.python_implementation()} {platform.python_version()}",
        )

    @property
    def formats(self) -> frozenset[ArtifactFormat]:
        """The formats this backend loads."""
        return frozenset({ArtifactFormat.CPU})

    @property
    def preferred_formats(self) -> tuple[ArtifactFormat, ...]:
        """Formats to choose registry entries in, best first."""
        return (ArtifactFormat.CPU,)

    @property
    def default_stream(self) -> StreamHandle:
        """The stream used when none is given."""
        return self._default_stream

    def _worker(self, stream: StreamHandle) -> _Worker:
        worker: _Worker = stream.native
        return worker

    @property
    def dlpack_device(self) -> tuple[int, int]:
        """Host memory: DLPack's ``(kDLCPU, 0)``."""
        return (1, 0)

    def _allocate(self, object_id: int, byte_size: int, alignment: int) -> Any:
        # Linux grants any size (overcommit) and kills the process when it is touched: a
        # large request is checked against what the machine has (reading that costs 15 us).
        available = host_memory_available() if byte_size >= _CHECKED_FROM_BYTES else None
        if available is not None and byte_size > available:
            raise OutOfDeviceMemory(
                f"cannot allocate {byte_size:,} bytes of host memory: "
                f"{available:,} bytes are available"
            )
        try:
            raw = np.empty(byte_size + alignment, dtype=np.uint8)
        except MemoryError as exc:
            raise OutOfDeviceMemory(f"cannot allocate {byte_size} bytes of host memory") from exc
        shift = (-raw.ctypes.data) % alignment
        return raw[shift : shift + byte_size]

    def _buffer_address(self, native: Any) -> int:
        address: int = native.ctypes.data
        return address

    def _write(
        self, buffer: BufferHandle, data: memoryview, offset: int, stream: StreamHandle
    ) -> None:
        worker = self._worker(stream)
        inline = data.nbytes <= _INLINE_BYTES and worker.settled_all()
        # Queued, the bytes are copied first: the caller may reuse ``data`` at once.
        source = np.frombuffer(data if inline else bytes(data), dtype=np.uint8)
        target: np.ndarray[Any, np.dtype[np.uint8]] = buffer.native
        end = offset + source.size

        def copy() -> None:
            target[offset:end] = source

        guarded = self._guarded(copy, f"write to {buffer!r}")
        if inline:  # nothing queued before it: in stream order already
            guarded()
        else:
            worker.put(guarded)

    def _copy(
        self,
        source: BufferHandle,
        source_offset: int,
        destination: BufferHandle,
        destination_offset: int,
        size: int,
        stream: StreamHandle,
    ) -> None:
        origin: np.ndarray[Any, np.dtype[np.uint8]] = source.native
        target: np.ndarray[Any, np.dtype[np.uint8]] = destination.native

        def copy() -> None:
            target[destination_offset : destination_offset + size] = origin[
                source_offset : source_offset + size
            ]

        self._worker(stream).put(self._guarded(copy, f"copy to {destination!r}"))

    def _enqueue_read(
        self, buffer: BufferHandle, offset: int, size: int, stream: StreamHandle
    ) -> PendingRead:
        read = _CpuRead()
        job = _ReadJob(self, read, buffer.native, offset, size)
        worker = self._worker(stream)
        if size <= _INLINE_BYTES and worker.settled_all():
            job()()  # nothing queued before it: in stream order already
        else:
            worker.put(job)
        return read

    def _fill(self, buffer: BufferHandle, pattern: int, stream: StreamHandle) -> None:
        if buffer.byte_size % 4:
            raise UnsupportedOperation(
                f"a 32-bit fill needs a size that is a multiple of 4, {buffer!r} has "
                f"{buffer.byte_size} bytes"
            )
        words = buffer.native.view(np.uint32)
        value = np.uint32(pattern)

        def fill() -> None:
            words[...] = value

        self._worker(stream).put(self._guarded(fill, f"fill of {buffer!r}"))

    async def _create_artifact(self, spec: ArtifactSpec) -> KernelArtifact:
        payload = spec.payload
        if not isinstance(payload, CpuKernelPayload):
            raise InvalidArtifact(f"a CPU artifact needs a cpu_kernel payload, got {payload!r}")
        function = lookup_cpu_kernel(payload.name)
        if function is None:
            raise InvalidArtifact(
                f"no CPU kernel is registered as {payload.name!r}; register one with "
                "@accy_async.cpu_kernel"
            )
        try:
            defines = parse_defines(spec.compile_options)
        except ValueError as exc:
            raise InvalidArtifact(str(exc), path="$.compile_options") from exc
        return KernelArtifact(spec, _CpuImage(function, defines), "cpu")

    async def _load_artifact(self, object_id: int, artifact: KernelArtifact) -> Any:
        if not isinstance(artifact.image, _CpuImage):
            raise InvalidArtifact(f"{artifact!r} holds no CPU kernel")
        return artifact.image

    def _create_stream(self, object_id: int) -> Any:
        worker = _Worker(f"accy-cpu-{self.backend_id}-stream-{object_id}")
        self._workers[object_id] = worker
        return worker

    def _create_event(self, object_id: int, timing: bool) -> Any:
        event = _CpuEvent()
        self._events[object_id] = event
        return event

    def _elapsed(self, start: EventHandle, end: EventHandle) -> float:
        first: _CpuEvent = start.native
        last: _CpuEvent = end.native
        return last.completed_at - first.completed_at

    def _record(self, event: EventHandle, stream: StreamHandle) -> None:
        state: _CpuEvent = event.native
        record = state.latest = Completion()
        timing = event.timing

        def complete() -> Callable[[], None]:
            if timing and state.latest is record:
                state.completed_at = time.perf_counter()
            error = self._health.fault

            def fire() -> None:
                record(error)
                with state.condition:
                    state.condition.notify_all()

            return fire

        self._worker(stream).put(complete)

    def _wait(self, stream: StreamHandle, event: EventHandle) -> None:
        state: _CpuEvent = event.native
        record = state.latest

        def wait() -> None:
            with state.condition:
                while not record.done and self._health.fault is None and not self._health.closed:
                    state.condition.wait(timeout=0.5)

        self._worker(stream).put(wait)

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
        for event in wait_events:
            self._wait(stream, event)
        image: _CpuImage = loaded.native
        function = image.function
        context = CpuLaunchContext(
            config.grid,
            config.block,
            config.shared_memory_bytes,
            diagnostic_id,
            image.defines,
        )
        views = [(b.handle.native, b.offset, b.offset + b.byte_size, b.access) for b in buffers]
        values = [argument.value for argument in scalars]

        def run() -> None:
            arrays = []
            for native, start, end, access in views:
                array = native[start:end]
                if access == "read_only":
                    array = array.view()
                    array.flags.writeable = False
                arrays.append(array)
            function(context, *arrays, *values)

        name = loaded.artifact.spec.kernel_name
        self._worker(stream).put(self._guarded(run, f"CPU kernel {name} ({describe(function)})"))
        if signal_event is not None:
            self._record(signal_event, stream)

    def _trace_stamp(self, stream: StreamHandle, record: TraceRecord, end: bool) -> None:
        """The stream's worker notes the time when it reaches this point (the host's clock)."""
        self._worker(stream).put(partial(Tracer.stamp, record, end))

    def _query_event(self, event: EventHandle) -> bool:
        state: _CpuEvent = event.native
        return state.latest.done

    def _query_stream(self, stream: StreamHandle) -> bool:
        return self._worker(stream).idle()

    def _notify_when_complete(
        self, event: EventHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        state: _CpuEvent = event.native
        return state.latest.register(callback)

    def _notify_when_stream_complete(
        self, stream: StreamHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        worker = self._worker(stream)
        if worker.settled_all():  # its work has run: no round trip to its thread
            callback(self.fault)
            return ALREADY_FIRED
        completion = Completion()
        registration = completion.register(callback)
        worker.put(_StreamMarkJob(self, completion))
        return registration

    def _destroy(self, obj: DeviceObject) -> None:
        if isinstance(obj, StreamHandle):
            worker = self._workers.pop(obj.id)
            worker.stop()
        elif isinstance(obj, EventHandle):
            self._events.pop(obj.id, None)
        # Buffers and loaded kernels are host objects: dropping the handle frees them
        # once queued work that captured them has run.

    async def _drain(self) -> None:
        markers = []
        for worker in list(self._workers.values()):
            marker = threading.Event()
            worker.put(marker.set)
            markers.append(marker)

        def wait_all() -> None:
            for marker in markers:
                marker.wait()

        await anyio.to_thread.run_sync(wait_all)

    def _close(self) -> None:
        for worker in self._workers.values():
            worker.stop()
        for worker in self._workers.values():
            worker.thread.join(timeout=5)
        self._workers.clear()
        self._wake_event_waiters()

    def _on_poisoned(self, fault: DeviceFault) -> None:
        # Queued records and stream markers still run after a fault (only guarded work
        # is skipped) and fire their callbacks with the fault; waits stop waiting.
        del fault
        self._wake_event_waiters()

    def _wake_event_waiters(self) -> None:
        for state in list(self._events.values()):
            with state.condition:
                state.condition.notify_all()

    # ----- worker side ---------------------------------------------------------------------

    def _guarded(self, operation: Callable[[], None], what: str) -> Callable[[], None]:
        """Run ``operation`` unless the backend is poisoned; poison it if it raises."""

        def guarded() -> None:
            if self._health.fault is not None:
                return
            try:
                operation()
            except BaseException as exc:  # noqa: BLE001 - a kernel's error is a device fault
                fault = DeviceFault(f"{what} failed: {type(exc).__name__}: {exc}")
                fault.__cause__ = exc
                fault.kernel_traceback = "".join(  # type: ignore[attr-defined]
                    traceback.format_exception(exc)
                )
                self.poison(fault)

        return guarded


_CHECKED_FROM_BYTES: Final = 64 << 20
"""Allocations this large or larger are checked against the host's available memory."""


def host_memory_available() -> int | None:
    """Bytes of memory the machine can still give (``MemAvailable``), ``None`` if unknown."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
