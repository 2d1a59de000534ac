"""What a backend implements: the primitives :class:`~accy_async.backends.Backend` calls.

:class:`BackendPrimitives` lists them. :class:`~accy_async.backends.Backend`
checks every argument (liveness, ranges, counts, health) and keeps the books
before it calls one, so a primitive trusts what it is given: ids are fresh,
objects live, ranges inside their buffers, the backend open. A primitive that
creates something returns its native form; the base wraps it in a handle.
Optional primitives have defaults here (no foreign streams, no stream marks).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

from ..errors import DeviceFault, UnsupportedOperation
from ..plan import ArtifactSpec, ScalarArgument
from ._completion import CompletionCallback, CompletionRegistration
from ._graph_exec import GraphExec, GraphNode, NodeArguments
from ._handles import (
    BufferBinding,
    BufferHandle,
    DeviceObject,
    EventHandle,
    KernelArtifact,
    LoadedArtifact,
    StreamHandle,
)
from ._launch_config import LaunchConfig
from ._marks import PendingRead, StreamMark
from ._trace import TraceRecord

__all__ = ["BackendPrimitives"]


class BackendPrimitives(abc.ABC):
    """The ``_``-prefixed primitives a backend implements (see the module docstring)."""

    kind: ClassVar[str]
    """The backend's kind: ``"cuda"``, ``"cpu"``, ``"recording"``."""

    @abc.abstractmethod
    def _allocate(self, object_id: int, byte_size: int, alignment: int) -> Any: ...

    @abc.abstractmethod
    def _write(
        self, buffer: BufferHandle, data: memoryview, offset: int, stream: StreamHandle
    ) -> None: ...

    @abc.abstractmethod
    def _enqueue_read(
        self, buffer: BufferHandle, offset: int, size: int, stream: StreamHandle
    ) -> PendingRead: ...

    @abc.abstractmethod
    def _fill(self, buffer: BufferHandle, pattern: int, stream: StreamHandle) -> None: ...

    @abc.abstractmethod
    def _copy(
        self,
        source: BufferHandle,
        source_offset: int,
        destination: BufferHandle,
        destination_offset: int,
        size: int,
        stream: StreamHandle,
    ) -> None: ...

    def _follow_peer(self, peer: Any, after: StreamHandle, stream: StreamHandle) -> None:
        """``stream`` waits, on the device, for ``peer``'s ``after`` so far (default: cannot)."""
        del after, stream
        raise UnsupportedOperation(
            f"the {self.kind} backend cannot wait on the device for a {peer.kind} backend's stream"
        )

    def _copies_from(self, source_backend: Any) -> bool:
        """Whether :meth:`_copy_from` can copy from ``source_backend``'s buffers (default: no)."""
        del source_backend
        return False

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
        """Copy from ``source_backend``'s buffer, on ``stream`` after ``after``.

        Called only where :meth:`_copies_from` said yes (by default never).
        """
        raise NotImplementedError

    @abc.abstractmethod
    async def _create_artifact(self, spec: ArtifactSpec) -> KernelArtifact: ...

    @abc.abstractmethod
    async def _load_artifact(self, object_id: int, artifact: KernelArtifact) -> Any: ...

    @abc.abstractmethod
    def _create_stream(self, object_id: int) -> Any: ...

    def _adopt_stream(self, object_id: int, raw: int) -> Any:
        """The native form of another library's raw stream ``raw`` (default: none taken)."""
        del object_id, raw
        raise UnsupportedOperation(
            f"the {self.kind} backend runs its own streams; it cannot use another library's"
        )

    def _forget_stream(self, stream: StreamHandle) -> None:
        """Drop what the backend kept about an adopted stream (default: nothing)."""
        del stream

    def _follow_foreign(self, stream: StreamHandle, raw: int) -> None:
        """``stream`` waits for the work queued so far on the raw stream ``raw`` (default: none)."""
        del stream, raw
        raise UnsupportedOperation(f"the {self.kind} backend has no foreign streams")

    def _lead_foreign(self, raw: int, stream: StreamHandle) -> None:
        """The raw stream ``raw`` waits for the work queued so far on ``stream`` (default: none)."""
        del raw, stream
        raise UnsupportedOperation(f"the {self.kind} backend has no foreign streams")

    @abc.abstractmethod
    def _create_event(self, object_id: int, timing: bool) -> Any: ...

    @abc.abstractmethod
    def _elapsed(self, start: EventHandle, end: EventHandle) -> float:
        """Seconds between two completed timing events' latest records."""

    @abc.abstractmethod
    def _record(self, event: EventHandle, stream: StreamHandle) -> None: ...

    @abc.abstractmethod
    def _wait(self, stream: StreamHandle, event: EventHandle) -> None: ...

    @abc.abstractmethod
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
    ) -> None: ...

    @abc.abstractmethod
    def _query_event(self, event: EventHandle) -> bool: ...

    @abc.abstractmethod
    def _query_stream(self, stream: StreamHandle) -> bool: ...

    @abc.abstractmethod
    def _notify_when_complete(
        self, event: EventHandle, callback: CompletionCallback
    ) -> CompletionRegistration: ...

    @abc.abstractmethod
    def _notify_when_stream_complete(
        self, stream: StreamHandle, callback: CompletionCallback
    ) -> CompletionRegistration: ...

    @abc.abstractmethod
    def _destroy(self, obj: DeviceObject) -> None: ...

    @abc.abstractmethod
    async def _drain(self) -> None:
        """Wait (without blocking the loop) until queued work has finished or failed."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the device itself (threads, context); objects are already destroyed."""

    def _on_poisoned(self, fault: DeviceFault) -> None:
        """Fail every pending completion callback with ``fault``; backends override."""
        del fault

    def _buffer_address(self, native: Any) -> int:
        """The address a kernel sees for a buffer's ``native`` object (0 if none)."""
        del native
        return 0

    def _trace_stamp(self, stream: StreamHandle, record: TraceRecord, end: bool) -> None:
        """Have ``record``'s device start (or end) noted when ``stream`` reaches this point.

        Default: the backend cannot tell (the trace shows the host's side only).
        """
        del stream, record, end

    def _mark_stream(self, stream: StreamHandle) -> StreamMark | None:
        """A mark of ``stream``'s work so far, for backends that offer one (default: none)."""
        del stream
        return None

    @abc.abstractmethod
    def _instantiate_graph(self, object_id: int, nodes: tuple[GraphNode, ...]) -> Any:
        """The backend's form of a graph of ``nodes`` (a default replays them, see graphs)."""

    @abc.abstractmethod
    def _launch_graph(
        self,
        graph: GraphExec,
        arguments: Sequence[NodeArguments],
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
    ) -> None:
        """Enqueue every node of ``graph`` on ``stream``, patched with ``arguments``."""

    @abc.abstractmethod
    def _destroy_graph(self, graph: GraphExec) -> None:
        """Release the backend's form of ``graph`` (launches of it may still run)."""
