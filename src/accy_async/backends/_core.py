"""The state every operation group of a backend shares, and the checks over it.

:class:`BackendCore` holds a backend's book of live objects (a
:class:`~._registry.Registry`: every object destroyed exactly once, or deferred
until the device is done with it) and its :class:`~._health.Health`, and the
checks each public operation makes before it calls a primitive. The operation
groups (:mod:`._buffer_operations`, :mod:`._stream_operations`) and
:class:`~accy_async.backends.Backend` build on it.
"""

from __future__ import annotations

import abc
import itertools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import DeviceFault, InvalidBuffer
from ._device_info import Limits
from ._graph_exec import GraphExec
from ._handles import (
    BufferBinding,
    BufferHandle,
    DeviceObject,
    EventHandle,
    Ownership,
    StreamHandle,
    StreamLike,
    raw_handle_of,
)
from ._health import Health
from ._primitives import BackendPrimitives
from ._registry import Registry
from ._trace import Tracer

__all__ = ["BackendCore"]

_backend_ids = itertools.count(1)
_T = TypeVar("_T")


class BackendCore(BackendPrimitives):
    """Live objects, deferred releases, health, and the argument checks built on them."""

    limits: Limits
    """Bounds checked before anything is allocated."""

    def __init__(self) -> None:
        self.backend_id = next(_backend_ids)
        """This backend's number: every handle it gives out carries it."""
        self._registry = Registry(self.backend_id)
        self._live = self._registry.live
        """The registry's live objects by id (the launch checks read it directly)."""
        self._health = Health(self.kind)
        self.tracer: Tracer | None = None
        """Where launches, copies and waits are recorded; ``None`` (the default): nowhere.

        Set by :func:`accy_async.trace`; see :mod:`accy_async.backends._trace`."""

    def _traced(
        self,
        kind: str,
        name: str,
        stream: StreamHandle,
        enqueue: Callable[[], _T],
        *,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
        **args: Any,
    ) -> _T:
        """``enqueue()``, recorded by the tracer.

        The host's span, and where the backend can tell and the tracer asks
        for it (:attr:`Tracer.device_times`), the device's (stamps on
        ``stream`` before and after). ``wait_events`` are waited for before
        the first stamp and ``signal_event`` recorded after the last, so the
        device's span is the work's own: ``enqueue`` must not wait or signal.
        """
        tracer = self.tracer
        assert tracer is not None
        for event in wait_events:
            self._wait(stream, event)
        record = tracer.begin(kind, name, stream.id, args or None)
        stamped = tracer.device_times
        try:
            if stamped:
                self._trace_stamp(stream, record, False)
            result = enqueue()
            if stamped:
                self._trace_stamp(stream, record, True)
        except BaseException as exc:
            record.failed(exc)
            raise
        finally:
            tracer.end(record)
        if signal_event is not None:
            self._record(signal_event, stream)
        return result

    @property
    @abc.abstractmethod
    def default_stream(self) -> StreamHandle:
        """The stream work goes to when none is given (not CUDA's legacy NULL stream)."""

    @abc.abstractmethod
    def adopt_stream(self, stream: StreamLike) -> StreamHandle:
        """Another library's stream as a handle of this backend (see the stream operations)."""

    # ----- live objects ----------------------------------------------------------------------

    def live_objects(self, *, owned_only: bool = False) -> Mapping[int, str]:
        """Every object created and not yet destroyed: id to kind (``buffer``, ``event``...).

        With ``owned_only``, external buffers (memory the backend does not own) are left out.
        """
        return {obj.id: obj.kind for obj in self._registry.objects(owned_only=owned_only)}

    def live_handles(self, *, owned_only: bool = False) -> list[DeviceObject]:
        """The handles of :meth:`live_objects` (the default stream left out), to destroy them."""
        default = self.default_stream
        return [obj for obj in self._registry.objects(owned_only=owned_only) if obj is not default]

    def owns(self, obj: DeviceObject) -> bool:
        """Whether ``obj`` is a live object of this backend."""
        return self._registry.owns(obj)

    @property
    def removals(self) -> int:
        """How many objects were destroyed (or forgotten) so far; it only grows.

        While it is unchanged, every object that was live is live still: a
        caller that checked its handles once checks again only when it moved.
        """
        return self._registry.removals

    def check_bindings(self, bindings: Sequence[BufferBinding], path: str = "$") -> None:
        """Raise :class:`InvalidBuffer` unless each binding is a live buffer of this backend.

        Each must also lie inside its buffer; the error's path is ``path[index]``.
        """
        live = self._live
        for index, binding in enumerate(bindings):
            handle = binding.handle
            if live.get(handle.id) is not handle or handle.backend_id != self.backend_id:
                raise InvalidBuffer(
                    f"{handle!r} is not a live buffer of this backend", path=f"{path}[{index}]"
                )
            if binding.offset < 0 or binding.offset + binding.byte_size > handle.byte_size:
                raise InvalidBuffer(
                    f"{binding!r} is outside its buffer of {handle.byte_size} bytes",
                    path=f"{path}[{index}]",
                )

    # ----- destruction ---------------------------------------------------------------------

    def destroy(self, obj: DeviceObject) -> None:
        """Destroy a buffer, loaded artifact, stream or event, exactly once.

        The device must no longer use it: destroy after the work queued on it
        has completed, or use :meth:`defer_destroy`. External buffers are only
        forgotten. Destroying is allowed after a fault and after close.
        """
        if obj is self.default_stream:
            raise InvalidBuffer("the default stream cannot be destroyed")
        if self._registry.ready and isinstance(obj, StreamHandle) and self.owns(obj):
            # Objects handed in to release after this stream wait for it while it still
            # lives (gone, they would wait for the default stream instead).
            self.collect_deferred()
        self._registry.remove(obj)
        if isinstance(obj, BufferHandle) and obj.ownership is Ownership.EXTERNAL:
            return
        if isinstance(obj, GraphExec):
            self._destroy_graph(obj)
            return
        if isinstance(obj, StreamHandle):
            raw = raw_handle_of(obj)
            adopted = self._registry.adopted
            if raw is not None and adopted.get(raw) is obj:
                del adopted[raw]
            if obj.external:
                self._forget_stream(obj)
                return
        self._destroy(obj)

    def destroy_all(self, objects: Iterable[DeviceObject]) -> None:
        """Destroy each object; a failure becomes a :class:`ResourceWarning` and the rest go on."""
        for obj in objects:
            try:
                self.destroy(obj)
            except Exception as exc:  # noqa: BLE001 - clean-up must go on
                warnings.warn(
                    f"accy-async: failed to destroy {obj!r}: {exc}", ResourceWarning, stacklevel=2
                )

    def defer_destroy(
        self,
        objects: Sequence[DeviceObject],
        after: StreamLike | Sequence[StreamLike | None] | None = None,
    ) -> None:
        """Destroy ``objects`` once the work now queued on the ``after`` stream(s) completes.

        For clean-up that must not wait (a cancelled or timed-out wait): the
        objects stay alive until the device is done with them, and are
        destroyed by a later call on this backend or at :meth:`aclose`.
        """
        if not objects:
            return
        if self._health.refusal is not None:
            self.destroy_all(objects)
            return
        streams = [self._stream(s) for s in (after if isinstance(after, Sequence) else [after])]
        on_complete = self._registry.defer(objects, len(streams))
        for stream in streams:
            self._notify_when_stream_complete(stream, on_complete)
        self.collect_deferred()  # streams that were idle already

    def release_from_any_thread(
        self, objects: Sequence[DeviceObject], after: StreamHandle | None = None
    ) -> None:
        """:meth:`defer_destroy` for code that may run on any thread (a finalizer).

        Nothing is destroyed or enqueued here: the objects are handed to the
        next call on this backend that collects deferred releases (a launch,
        an allocation, destroying ``after``, :meth:`aclose`), which defers
        them after ``after`` (the default stream if ``after`` is gone by then).
        """
        self._registry.orphan(objects, after)

    def collect_deferred(self) -> None:
        """Destroy the deferred objects whose work has completed."""
        registry = self._registry
        if not registry.ready:
            return
        orphans_wait, tokens = registry.take_ready()
        if orphans_wait:
            orphaned = registry.take_orphans()
            while orphaned:  # popped, oldest first, so nothing here keeps them referenced after
                objects, stream = orphaned.popleft()
                live = [obj for obj in objects if self.owns(obj)]
                self.defer_destroy(live, after=stream if stream and self.owns(stream) else None)
        done = registry.take_released(tokens)
        while done:  # popped, so nothing here keeps them referenced after
            self.destroy_all(done.pop())

    @property
    def deferred_count(self) -> int:
        """How many objects wait in deferred releases."""
        return self._registry.deferred_count

    # ----- health and checks -----------------------------------------------------------------

    def poison(self, fault: DeviceFault) -> None:
        """Record a sticky fault: every later call raises it, every waiter fails with it."""
        if self._health.poison(fault):
            self._on_poisoned(fault)

    def _check_usable(self) -> None:
        if self._health.refusal is not None:
            self._health.refuse()

    def _stream(self, stream: StreamLike | None) -> StreamHandle:
        if stream is None:
            return self.default_stream
        if type(stream) is not StreamHandle:
            return self.adopt_stream(stream)
        if self._live.get(stream.id) is not stream and stream is not self.default_stream:
            raise InvalidBuffer(f"{stream!r} is not a live stream of this backend")
        return stream

    def _check_live(self, obj: DeviceObject) -> None:
        if not self.owns(obj):
            raise InvalidBuffer(f"{obj!r} is not a live {obj.kind} of this backend")

    def _check_buffer(self, buffer: BufferHandle) -> None:
        self._check_live(buffer)

    def _check_range(self, buffer: BufferHandle, offset: int, size: int) -> None:
        self._check_buffer(buffer)
        if offset < 0 or size < 0 or offset + size > buffer.byte_size:
            raise InvalidBuffer(
                f"range [{offset}:{offset + size}] is outside {buffer!r} "
                f"of {buffer.byte_size} bytes"
            )
