"""The recording backend: a real, public test double that records calls and injects faults.

It executes nothing. It counts allocations, creates, loads, launches, fills,
records and destroys; remembers the ids it handed out and the last one
destroyed; refuses destroyed or unknown handles like every backend; and fails
the call you name with the error you name (:meth:`RecordingBackend.inject_fault`).
Use it in your own tests the way you would use httpx's ``MockTransport``::

    backend = RecordingBackend(fail_after={"load": 1})   # the second load fails
    with pytest.raises(accy.RuntimeUnavailable):
        await accy.launch_pipeline(backend, request)
    assert backend.load_count == 1 and not backend.live_objects()

Events complete as soon as they are recorded unless the backend is built with
``completion="manual"``; then launches and records stay pending until
:meth:`complete_stream` (or :meth:`complete_all`, or :meth:`complete` for one
event) is called, so tests can hold work "on the device" while they cancel or
fail something. A stream with nothing pending is idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from ..errors import (
    AccyError,
    DeviceFault,
    InvalidArtifact,
    OutOfDeviceMemory,
    RuntimeUnavailable,
    UnsupportedOperation,
)
from ..plan import ArtifactFormat, ArtifactSpec, ScalarArgument
from ._completion import Completion, CompletionCallback, CompletionRegistration
from ._device_info import DeviceIdentity, Limits, WaitPolicy
from ._graph_exec import GraphExec, GraphNode, NodeArguments
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

__all__ = [
    "FAULT_ERRORS",
    "FAULT_KINDS",
    "FaultKind",
    "RecordedLaunch",
    "RecordingBackend",
    "fault_error",
]

FaultKind: TypeAlias = Literal[
    "allocate",
    "write",
    "copy",
    "read",
    "fill",
    "create",
    "load",
    "stream",
    "event",
    "record",
    "wait",
    "launch",
    "query",
    "destroy",
    "instantiate",
    "graph_launch",
]
"""The kinds of call a fault can be injected into."""

FAULT_KINDS: Final[tuple[FaultKind, ...]] = (
    "allocate",
    "write",
    "copy",
    "read",
    "fill",
    "create",
    "load",
    "stream",
    "event",
    "record",
    "wait",
    "launch",
    "query",
    "destroy",
    "instantiate",
    "graph_launch",
)

FAULT_ERRORS: Final[Mapping[FaultKind, type[AccyError]]] = {
    "allocate": OutOfDeviceMemory,
    "create": InvalidArtifact,
    "load": RuntimeUnavailable,
    "fill": UnsupportedOperation,
    "query": DeviceFault,
}
"""The error an injected fault of each kind raises by default (the others:
:class:`RuntimeUnavailable`)."""


def fault_error(kind: FaultKind) -> type[AccyError]:
    """The error class an injected fault of ``kind`` raises by default."""
    return FAULT_ERRORS.get(kind, RuntimeUnavailable)


@dataclass(frozen=True, slots=True)
class RecordedLaunch:
    """One launch as the recording backend saw it."""

    kernel_name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_memory_bytes: int
    buffer_ids: tuple[int, ...]
    buffer_access: tuple[str, ...]
    scalars: tuple[ScalarArgument, ...]
    buffer_addresses: tuple[int, ...]
    """Where each bound range starts (callers' device memory has no buffer id of its own)."""
    stream_id: int
    wait_event_ids: tuple[int, ...]
    signal_event_id: int | None
    diagnostic_id: str | None

    @property
    def first_scalar_u32(self) -> int | None:
        """The first scalar if it is a u32 (the seed's ``launch_scalar_u32s``)."""
        if self.scalars and self.scalars[0].type_name == "u32":
            return int(self.scalars[0].value)
        return None


@dataclass(slots=True)
class _Fault:
    after: int
    error: Callable[[str], AccyError]
    repeat: bool
    fired: int = 0


class _Pending(Completion):
    """Something that completes: an event's record or a stream marker; and when it did."""

    __slots__ = ("completed_at",)

    def __init__(self) -> None:
        super().__init__()
        self.completed_at = 0.0


class _RecordingRead(PendingRead):
    __slots__ = ("_backend", "_data", "_pending")

    def __init__(self, backend: RecordingBackend, pending: _Pending, data: bytes) -> None:
        self._backend = backend
        self._pending = pending
        self._data = data

    def notify_when_complete(self, callback: CompletionCallback) -> CompletionRegistration:
        return self._pending.register(callback)

    def result(self) -> memoryview:
        return memoryview(self._data)

    def discard(self) -> None:
        self._data = b""


class RecordingBackend(Backend):
    """A backend that records what it is asked to do and fails on request.

    ``kind_label`` and ``formats`` say which device it pretends to be (the
    seeds' recording state is ``.kind = .cuda, .format = .cuda_ptx``).
    ``fail_after`` maps a call kind to N: the first N such calls succeed and
    every later one fails with that kind's default error (allocate:
    :class:`OutOfDeviceMemory`, load: :class:`RuntimeUnavailable`, create:
    :class:`InvalidArtifact`, fill: :class:`UnsupportedOperation`, query:
    :class:`DeviceFault`, others :class:`RuntimeUnavailable`).
    """

    kind = "recording"

    def __init__(
        self,
        *,
        formats: Sequence[ArtifactFormat] = (
            ArtifactFormat.CUDA_PTX,
            ArtifactFormat.CUDA_SOURCE,
            ArtifactFormat.CUDA_CUBIN,
            ArtifactFormat.CPU,
        ),
        fail_after: Mapping[FaultKind, int] | None = None,
        completion: Literal["immediate", "manual"] = "immediate",
        limits: Limits | None = None,
        wait_policy: WaitPolicy = "balanced",
    ) -> None:
        super().__init__(limits=limits, wait_policy=wait_policy)
        self._formats = frozenset(formats)
        self._preferred = tuple(formats)
        self._completion = completion
        self._faults: dict[FaultKind, _Fault] = {}
        for kind, after in (fail_after or {}).items():
            self.inject_fault(kind, after=after, repeat=True)
        self.calls: dict[FaultKind, int] = dict.fromkeys(FAULT_KINDS, 0)
        """Successful calls of each kind."""
        self.launches: list[RecordedLaunch] = []
        self.graph_launches: list[tuple[int, int]] = []
        """``(graph id, stream id)`` of each graph launch (its nodes are in ``launches`` too)."""
        self.allocated_buffer_ids: list[int] = []
        self.allocated_buffer_byte_sizes: list[int] = []
        self.destroyed_ids: list[int] = []
        self.fills: list[tuple[int, int]] = []
        self.writes: list[tuple[int, int, bytes]] = []
        self.copies: list[tuple[int, int, int, int, int]] = []
        """``(source id, source offset, destination id, destination offset, size)``."""
        self.created_specs: list[ArtifactSpec] = []
        self.loaded_ids: list[int] = []
        self.records: list[tuple[int, int]] = []
        self.waits: list[tuple[int, int]] = []
        self.foreign_orders: list[tuple[str, int, int]] = []
        """``("follow", our stream id, raw handle)`` and ``("lead", raw handle, our stream id)``."""
        self._events: dict[int, _Pending] = {}
        self._unfinished: dict[int, list[_Pending]] = {}
        default_id = DEFAULT_STREAM_ID
        self._default_stream = StreamHandle(self.backend_id, default_id, None)
        self._unfinished[default_id] = []

    # ----- fault injection -----------------------------------------------------------------

    def inject_fault(
        self,
        kind: FaultKind,
        *,
        after: int = 0,
        error: Callable[[str], AccyError] | None = None,
        repeat: bool = False,
    ) -> None:
        """Fail the call of ``kind`` that comes after ``after`` successful ones.

        ``error`` builds the exception from a message (default: the kind's, see
        the class docstring). With ``repeat`` every later call fails too;
        otherwise only the first one does.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        chosen = error or fault_error(kind)
        self._faults[kind] = _Fault(after=after, error=chosen, repeat=repeat)

    def faults_fired(self, kind: FaultKind) -> int:
        """How many times the fault injected for ``kind`` has fired (0 if none is injected)."""
        fault = self._faults.get(kind)
        return 0 if fault is None else fault.fired

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        self._faults.clear()

    def _maybe_fail(self, kind: FaultKind) -> None:
        fault = self._faults.get(kind)
        if fault is None or self.calls[kind] < fault.after:
            return
        if not fault.repeat and fault.fired:
            return
        fault.fired += 1
        error = fault.error(f"injected fault: {kind} call {self.calls[kind] + 1} fails")
        if isinstance(error, DeviceFault):
            self.poison(error)
        raise error

    def _succeeded(self, kind: FaultKind) -> None:
        self.calls[kind] += 1

    # ----- the seed's counters -------------------------------------------------------------

    @property
    def buffer_allocate_count(self) -> int:
        """Successful buffer allocations."""
        return self.calls["allocate"]

    @property
    def create_count(self) -> int:
        """Successful artifact creations."""
        return self.calls["create"]

    @property
    def load_count(self) -> int:
        """Successful artifact loads."""
        return self.calls["load"]

    @property
    def launch_count(self) -> int:
        """Successful launches."""
        return self.calls["launch"]

    @property
    def destroy_count(self) -> int:
        """Objects destroyed."""
        return self.calls["destroy"]

    @property
    def fill_count(self) -> int:
        """Successful fills."""
        return self.calls["fill"]

    @property
    def last_destroyed_id(self) -> int | None:
        """The id of the last object destroyed, or ``None``."""
        return self.destroyed_ids[-1] if self.destroyed_ids else None

    def external_buffer(self, byte_size: int) -> BufferHandle:
        """A buffer the caller owns (not counted as an allocation; destroying forgets it)."""
        return self.register_external_buffer(None, byte_size)

    # ----- manual completion ---------------------------------------------------------------

    def pending_count(self) -> int:
        """Records and stream markers not yet completed (``completion="manual"``)."""
        return sum(len(items) for items in self._unfinished.values())

    def complete(self, event: EventHandle) -> None:
        """Complete ``event``'s latest record and run its callbacks."""
        self._finish(self._events[event.id])

    def complete_all(self) -> None:
        """Complete everything recorded or marked so far, on every stream."""
        for stream_id in list(self._unfinished):
            self.complete_stream(stream_id)

    def complete_stream(self, stream: StreamHandle | int) -> None:
        """Complete everything recorded or marked so far on ``stream``."""
        stream_id = stream if isinstance(stream, int) else stream.id
        items, self._unfinished[stream_id] = self._unfinished.get(stream_id, []), []
        for pending in items:
            self._finish(pending)

    @staticmethod
    def _finish(pending: _Pending) -> None:
        if not pending.done:
            pending.completed_at = time.perf_counter()
            pending(None)

    def _enqueue(self, stream: StreamHandle, pending: _Pending) -> None:
        if self._completion == "immediate":
            self._finish(pending)
        else:
            self._unfinished.setdefault(stream.id, []).append(pending)

    # ----- Backend -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The device's name."""
        return "recording"

    @property
    def identity(self) -> DeviceIdentity:
        """A fixed identity: nothing is measured on a recording backend."""
        return DeviceIdentity(kind="recording", name="recording", uuid="", driver="", compiler="")

    @property
    def formats(self) -> frozenset[ArtifactFormat]:
        """The formats this backend loads."""
        return self._formats

    @property
    def preferred_formats(self) -> tuple[ArtifactFormat, ...]:
        """Formats to choose registry entries in, best first."""
        return self._preferred

    @property
    def default_stream(self) -> StreamHandle:
        """The stream used when none is given."""
        return self._default_stream

    def _allocate(self, object_id: int, byte_size: int, alignment: int) -> Any:
        self._maybe_fail("allocate")
        self._succeeded("allocate")
        self.allocated_buffer_ids.append(object_id)
        self.allocated_buffer_byte_sizes.append(byte_size)
        return None

    def _write(
        self, buffer: BufferHandle, data: memoryview, offset: int, stream: StreamHandle
    ) -> None:
        self._maybe_fail("write")
        self._succeeded("write")
        self.writes.append((buffer.id, offset, bytes(data)))

    def _copy(
        self,
        source: BufferHandle,
        source_offset: int,
        destination: BufferHandle,
        destination_offset: int,
        size: int,
        stream: StreamHandle,
    ) -> None:
        self._maybe_fail("copy")
        self._succeeded("copy")
        self.copies.append((source.id, source_offset, destination.id, destination_offset, size))

    def _enqueue_read(
        self, buffer: BufferHandle, offset: int, size: int, stream: StreamHandle
    ) -> PendingRead:
        self._maybe_fail("read")
        self._succeeded("read")
        pending = _Pending()
        self._enqueue(stream, pending)
        return _RecordingRead(self, pending, bytes(size))

    def _fill(self, buffer: BufferHandle, pattern: int, stream: StreamHandle) -> None:
        self._maybe_fail("fill")
        self._succeeded("fill")
        self.fills.append((buffer.id, pattern))

    async def _create_artifact(self, spec: ArtifactSpec) -> KernelArtifact:
        self._maybe_fail("create")
        self._succeeded("create")
        self.created_specs.append(spec)
        return KernelArtifact(spec, None, "recorded")

    async def _load_artifact(self, object_id: int, artifact: KernelArtifact) -> Any:
        self._maybe_fail("load")
        self._succeeded("load")
        self.loaded_ids.append(object_id)
        return None

    def _create_stream(self, object_id: int) -> Any:
        self._maybe_fail("stream")
        self._succeeded("stream")
        self._unfinished[object_id] = []
        return None

    def _follow_foreign(self, stream: StreamHandle, raw: int) -> None:
        self.foreign_orders.append(("follow", stream.id, raw))  # no device to order

    def _lead_foreign(self, raw: int, stream: StreamHandle) -> None:
        self.foreign_orders.append(("lead", raw, stream.id))

    def _adopt_stream(self, object_id: int, raw: int) -> Any:
        """Another library's stream, as CUDA takes one: the raw handle is the native."""
        self._unfinished[object_id] = []
        return raw

    def _forget_stream(self, stream: StreamHandle) -> None:
        if not self._unfinished.get(stream.id):
            self._unfinished.pop(stream.id, None)

    def _elapsed(self, start: EventHandle, end: EventHandle) -> float:
        """Wall-clock seconds between the two records' completion (no device runs here)."""
        return self._events[end.id].completed_at - self._events[start.id].completed_at

    def _create_event(self, object_id: int, timing: bool) -> Any:
        self._maybe_fail("event")
        self._succeeded("event")
        never_recorded = self._events[object_id] = _Pending()
        never_recorded(None)  # counts as complete
        return None

    def _record(self, event: EventHandle, stream: StreamHandle) -> None:
        self._maybe_fail("record")
        self._succeeded("record")
        self.records.append((event.id, stream.id))
        pending = _Pending()
        self._events[event.id] = pending
        self._enqueue(stream, pending)

    def _wait(self, stream: StreamHandle, event: EventHandle) -> None:
        self._maybe_fail("wait")
        self._succeeded("wait")
        self.waits.append((stream.id, event.id))

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
        self._maybe_fail("launch")
        self._succeeded("launch")
        self.launches.append(
            RecordedLaunch(
                kernel_name=loaded.artifact.spec.kernel_name,
                grid=config.grid,
                block=config.block,
                shared_memory_bytes=config.shared_memory_bytes,
                buffer_ids=tuple(binding.handle.id for binding in buffers),
                buffer_access=tuple(binding.access for binding in buffers),
                scalars=tuple(scalars),
                buffer_addresses=tuple(binding.address for binding in buffers),
                stream_id=stream.id,
                wait_event_ids=tuple(event.id for event in wait_events),
                signal_event_id=None if signal_event is None else signal_event.id,
                diagnostic_id=diagnostic_id,
            )
        )
        if self._completion == "manual":
            self._enqueue(stream, _Pending())  # the launch itself "runs" until completed
        if signal_event is not None:
            self._record(signal_event, stream)

    def _query_event(self, event: EventHandle) -> bool:
        self._maybe_fail("query")
        self._succeeded("query")
        return self._events[event.id].done

    def _query_stream(self, stream: StreamHandle) -> bool:
        self._maybe_fail("query")
        self._succeeded("query")
        return not self._unfinished.get(stream.id)

    def _notify_when_complete(
        self, event: EventHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        return self._events[event.id].register(callback)

    def _notify_when_stream_complete(
        self, stream: StreamHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        pending = _Pending()
        if self._unfinished.get(stream.id):
            self._enqueue(stream, pending)
        else:  # nothing queued there: the stream is already idle
            pending(None)
        return pending.register(callback)

    def _destroy(self, obj: DeviceObject) -> None:
        self._maybe_fail("destroy")
        self._succeeded("destroy")
        self.destroyed_ids.append(obj.id)
        if isinstance(obj, EventHandle):
            del self._events[obj.id]
        elif isinstance(obj, StreamHandle) and not self._unfinished.get(obj.id):
            # A destroyed stream's queued work still completes (as on CUDA): keep it if any.
            self._unfinished.pop(obj.id, None)

    def _instantiate_graph(self, object_id: int, nodes: tuple[GraphNode, ...]) -> Any:
        self._maybe_fail("instantiate")
        self._succeeded("instantiate")
        return super()._instantiate_graph(object_id, nodes)

    def _launch_graph(
        self,
        graph: GraphExec,
        arguments: Sequence[NodeArguments],
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
    ) -> None:
        self._maybe_fail("graph_launch")
        self._succeeded("graph_launch")
        self.graph_launches.append((graph.id, stream.id))
        super()._launch_graph(graph, arguments, stream, wait_events, signal_event)

    def _trace_stamp(self, stream: StreamHandle, record: TraceRecord, end: bool) -> None:
        """Nothing runs here: the device's times are the enqueue's."""
        del stream
        Tracer.stamp(record, end)

    async def _drain(self) -> None:
        return None

    def _close(self) -> None:
        return None

    def _on_poisoned(self, fault: DeviceFault) -> None:
        pendings = [*self._events.values()]
        for items in self._unfinished.values():
            pendings.extend(items)
        self._unfinished = {stream_id: [] for stream_id in self._unfinished}
        for pending in pendings:
            pending(fault)
