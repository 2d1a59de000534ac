"""A backend's streams and events: create, adopt another library's, record, wait, time.

Streams are in-order queues of device work; events mark a point in one. Every
wait here is on the device (a stream waits for an event), never on the host:
:mod:`accy_async.waiting` turns completion into something a task awaits.
"""

from __future__ import annotations

from ..errors import UnsupportedOperation
from ._core import BackendCore
from ._handles import EventHandle, StreamHandle, StreamLike, raw_handle_of, raw_stream_handle

__all__ = ["StreamOperations"]


class StreamOperations(BackendCore):
    """Streams and events of the device, this backend's and other libraries'."""

    def live_streams(self) -> list[StreamHandle]:
        """The default stream and every stream created and not destroyed."""
        streams = [self.default_stream]
        streams.extend(obj for obj in self._live.values() if isinstance(obj, StreamHandle))
        return streams

    def create_stream(self) -> StreamHandle:
        """A new stream, independent of the default one."""
        self._check_usable()
        object_id = self._registry.new_id()
        stream = StreamHandle(self.backend_id, object_id, self._create_stream(object_id))
        self._registry.add(stream)
        return stream

    def adopt_stream(self, stream: StreamLike) -> StreamHandle:
        """Another library's stream as a :class:`StreamHandle` of this backend, not owned.

        ``stream`` is anything :data:`StreamLike` names; a handle of this
        backend comes back as it is. The same raw stream gives the same handle
        each time, so its forecast carries over. The backend never destroys
        the stream itself (destroying the handle only forgets it) and closing
        the backend does not warn about it. Every function that takes a
        stream adopts it this way, so ``stream=torch.cuda.current_stream()``
        works anywhere. Raises :class:`InvalidBuffer` for something that is
        not a stream or is another device's, and
        :class:`~accy_async.errors.UnsupportedOperation` on backends without
        CUDA streams (the CPU backend).
        """
        if type(stream) is StreamHandle:
            return self._stream(stream)
        self._check_usable()
        raw = raw_stream_handle(stream)
        adopted = self._registry.adopted
        known = adopted.get(raw)
        if known is not None:
            return known
        for ours in self.live_streams():  # one of ours, by its raw handle: not an alias
            if not ours.external and raw_handle_of(ours) == raw:
                adopted[raw] = ours
                return ours
        object_id = self._registry.new_id()
        handle = StreamHandle(
            self.backend_id, object_id, self._adopt_stream(object_id, raw), external=True
        )
        self._registry.add(handle)
        adopted[raw] = handle
        return handle

    def create_event(self, *, timing: bool = False) -> EventHandle:
        """A new event. Never recorded, it counts as complete.

        Dependency events keep timing off (it is cheaper on CUDA); ``timing``
        events can be given to :meth:`elapsed_seconds`.
        """
        self._check_usable()
        object_id = self._registry.new_id()
        native = self._create_event(object_id, timing)
        event = EventHandle(self.backend_id, object_id, native, timing=timing)
        self._registry.add(event)
        return event

    def elapsed_seconds(self, start: EventHandle, end: EventHandle) -> float:
        """Device time between the completion of ``start``'s and ``end``'s latest records.

        Both must be live timing events (``create_event(timing=True)``) whose
        records have completed, else :class:`UnsupportedOperation`. On the CPU
        backend this is the wall-clock time between the two records running on
        their streams' worker threads.
        """
        self._check_usable()
        for event in (start, end):
            self._check_live(event)
            if not event.timing:
                raise UnsupportedOperation(f"{event!r} was created without timing")
            if not self._query_event(event):
                raise UnsupportedOperation(f"{event!r} has not completed")
        return self._elapsed(start, end)

    def record_event(self, event: EventHandle, stream: StreamLike | None = None) -> None:
        """Record ``event`` on ``stream``: it completes when the work enqueued before has."""
        self._check_usable()
        self._check_live(event)
        self._record(event, self._stream(stream))

    def wait_event(self, stream: StreamLike | None, event: EventHandle) -> None:
        """Make ``stream`` wait, on the device, for ``event``'s latest record."""
        self._check_usable()
        self._check_live(event)
        self._wait(self._stream(stream), event)

    def follow_foreign_stream(self, stream: StreamLike | None, foreign: StreamLike) -> None:
        """Make ``stream`` wait, on the device, for the work queued so far on ``foreign``.

        ``foreign`` is a stream this backend does not own (another library's:
        PyTorch's, CuPy's, as an object or a raw handle; 1 and 2 are CUDA's
        legacy and per-thread default streams). Nothing waits on the host. Only backends with such
        streams (CUDA) support it.
        """
        self._check_usable()
        self._follow_foreign(self._stream(stream), raw_stream_handle(foreign))

    def follow_peer_stream(
        self, stream: StreamLike | None, peer: StreamOperations, after: StreamLike | None
    ) -> None:
        """Make ``stream`` wait, on the device, for the work queued so far on ``peer``'s ``after``.

        ``peer`` is another backend (another device's, say) or this one. Nothing
        waits on the host. Between two backends only CUDA's can
        (:class:`~accy_async.errors.UnsupportedOperation` otherwise: wait for
        ``after`` on the host instead).
        """
        self._check_usable()
        peer._check_usable()
        handle, peer_handle = self._stream(stream), peer._stream(after)
        if peer is self:
            if handle is not peer_handle:
                event = self.create_event()
                self._record(event, peer_handle)
                self._wait(handle, event)
                self.defer_destroy([event], after=handle)
            return
        self._follow_peer(peer, peer_handle, handle)

    def lead_foreign_stream(self, foreign: StreamLike, stream: StreamLike | None) -> None:
        """Make the raw stream ``foreign`` wait, on the device, for the work queued on ``stream``.

        See :meth:`follow_foreign_stream`.
        """
        self._check_usable()
        self._lead_foreign(raw_stream_handle(foreign), self._stream(stream))
