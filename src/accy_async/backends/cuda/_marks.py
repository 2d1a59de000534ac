"""Completion of the CUDA backend's own work: stream marks and device-to-host reads.

A :class:`CudaStreamMark` is a pooled marker event recorded on a stream; a
:class:`CudaRead` is a copy into pinned staging memory followed by a mark. Both
talk to the backend through its :class:`~._device.DeviceState` only.
"""

from __future__ import annotations

import ctypes
import time
from functools import partial
from typing import TYPE_CHECKING

from .._completion import Completion, CompletionCallback, CompletionRegistration
from .._handles import StreamHandle
from .._marks import PendingRead, StreamMark
from ..forecast import Anticipation
from .driver import driver

if TYPE_CHECKING:
    from ..base import Backend
    from ._device import DeviceState

__all__ = ["CudaRead", "CudaStreamMark"]


class CudaStreamMark(Completion, StreamMark):
    """A pooled marker event recorded on a stream: a position in the stream's ledger.

    It fires (as a :class:`Completion`) when a query from the loop sees the
    marker complete, or when the reactor does once someone asked to be
    called back; either sighting teaches the forecast.
    """

    __slots__ = (
        "_device",
        "_ledger",
        "_marker",
        "_pending_at",
        "_position",
        "_stream",
        "_watched",
    )

    def __init__(self, device: DeviceState, stream: StreamHandle) -> None:
        super().__init__()
        marker = device.take_marker()
        (result,) = driver().cuEventRecord(marker, stream.native)
        if int(result):
            device.recycle_marker(marker)
            device.fail(result, "recording a marker")
        ledger = device.ledger(stream)
        self._device = device
        self._marker = marker
        self._stream = stream.native
        self._ledger = ledger
        self._position = ledger.position
        self._pending_at: float | None = None
        self._watched = False

    @property
    def backend(self) -> Backend:
        """The backend whose stream was marked."""
        return self._device.owner

    def query(self) -> bool:
        device = self._device
        health = device.health
        if health.refusal is not None:
            health.refuse()
        if self.done:
            return True
        (result,) = driver().cuEventQuery(self._marker)
        now = time.perf_counter()
        if result == device.success:
            self._ledger.sighted(self._position, self._pending_at, now)
            self(None)
            return True
        if result != device.not_ready:
            device.fail(result, "querying a stream")
        self._pending_at = now
        return False

    def anticipate(self) -> Anticipation | None:
        if not self._device.owner.polled_from_loop:
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
        self._device.reactor.watch(self._marker, self._stream, self)

    def _sighted(self, error: BaseException | None) -> None:
        """On the reactor's thread: tell the ledger (a late sighting, at best a bracket)."""
        if error is None:
            self._ledger.sighted(self._position, self._pending_at, time.perf_counter())

    def release(self) -> None:
        device, marker = self._device, self._marker
        if device.owner.closed:
            return  # the context took the marker with it
        # Recycle the marker once the device is past it: at once if it was seen complete,
        # else when the reactor sees it (at once after a fault: it fails every watch then).
        self.watch()
        self.register(lambda error: device.recycle_marker(marker))


class CudaRead(PendingRead):
    """A device-to-host copy into pinned staging memory, followed by a stream mark.

    The staging block goes back to the pool only once the copy has landed,
    also when the read is discarded while the copy is still in flight.
    """

    __slots__ = ("_capacity", "_device", "_done", "_host", "_mark", "_size")

    def __init__(
        self, device: DeviceState, host: int, capacity: int, size: int, mark: CudaStreamMark
    ) -> None:
        self._device = device
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
        give_back = partial(self._device.staging.give_back, self._host, self._capacity)
        mark = self._mark
        if mark.done or self._device.owner.fault is not None:
            give_back()
        else:  # the copy may still be landing there: give the block back once it has
            mark.watch()
            mark.register(lambda error: give_back())
        mark.release()
