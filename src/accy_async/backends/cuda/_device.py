"""What the CUDA backend's parts share: the context, the work ledgers, the markers, the reactor.

:class:`DeviceState` is the one internal interface between the backend and its
stream marks, pending reads and stage launchers: they hold it, never the
backend's private attributes. It keeps each fact once: a stream's ledger of
queued work (for the forecast), an event's latest record, the pool of marker
events, and how a failed driver call is turned into an error (a sticky one
poisons the backend through the ``poison`` callback).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from ...errors import DeviceFault
from .._completion import Completion
from .._handles import EventHandle, StreamHandle
from ..forecast import Forecast, Ledger
from ._memory import BlockCache, Janitor, Staging
from ._module_shelf import ModuleShelf
from ._trace_clock import TraceClock
from .driver import driver, translate
from .reactor import CompletionReactor

if TYPE_CHECKING:
    from .._health import Health
    from ..base import Backend

__all__ = ["DeviceState", "DriverResults", "Record"]

_MARKER_POOL_SIZE = 1024


class Record:
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


class DriverResults:
    """How a failed driver call becomes an error: the backend's and its parts' one way.

    ``poison`` makes a device fault sticky (the backend's :meth:`Backend.poison`).
    """

    __slots__ = ("poison",)

    def __init__(self, poison: Callable[[DeviceFault], None]) -> None:
        self.poison = poison

    def fail(self, code: Any, action: str) -> NoReturn:
        """Raise the error of a failed driver call (a device fault poisons the backend first)."""
        error = translate(code, action)
        if isinstance(error, DeviceFault):
            self.poison(error)
        raise error

    def check(self, result: Any, action: str) -> None:
        """Raise if the driver call's ``CUresult`` (alone or first of a tuple) is an error."""
        code = result[0] if isinstance(result, tuple) else result
        if int(code):
            self.fail(code, action)

    def value(self, result: tuple[Any, ...], action: str) -> Any:
        """The value of a driver call's ``(CUresult, value)``, or its error raised."""
        if int(result[0]):
            self.fail(result[0], action)
        return result[1]


class DeviceState(DriverResults):
    """The context's shared state; made by the backend, used by every part of it.

    ``owner`` is the backend, read through its public face only (``closed``,
    ``fault``, ``polled_from_loop``); ``health`` is its one state (what calls
    raise once it is poisoned or closed); ``poison`` makes a fault sticky.
    Used from the event loop's thread, but for what the reactor's thread uses
    too: the marker and staging pools (locked), ``poison`` (a fault it sees),
    and the ledgers' sightings (see :class:`~..forecast.Ledger`).
    """

    __slots__ = (
        "_markers",
        "_markers_lock",
        "blocks",
        "context",
        "context_address",
        "event_flags",
        "forecast",
        "health",
        "janitor",
        "launch_kernel",
        "ledgers",
        "not_ready",
        "owner",
        "reactor",
        "records",
        "shelf",
        "staged",
        "staging",
        "stranded",
        "success",
        "trace_clock",
    )

    def __init__(
        self,
        owner: Backend,
        context: Any,
        *,
        health: Health,
        poison: Callable[[DeviceFault], None],
        poll_interval: float,
        memory_cache_bytes: int,
        keep_nothing: bool = False,
    ) -> None:
        d = driver()
        self.context = context
        self.context_address = int(context)
        """The context's handle as an int (to compare with the current one)."""
        self.health = health
        super().__init__(poison)
        self.owner = owner
        self.success = d.CUresult.CUDA_SUCCESS
        self.not_ready = d.CUresult.CUDA_ERROR_NOT_READY
        self.event_flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.launch_kernel = d.cuLaunchKernel
        self.forecast = Forecast()
        self.ledgers: dict[int, Ledger] = {}
        """Each stream's queued work, by the stream handle's id."""
        self.records: dict[int, Record] = {}
        """Each event's latest record, by the event handle's id."""
        self.janitor = Janitor(context)
        self.staging = Staging(self.janitor)
        self.blocks = BlockCache(0 if keep_nothing else memory_cache_bytes)
        """Device memory of destroyed buffers, kept for the next allocations."""
        self.shelf = ModuleShelf(0) if keep_nothing else ModuleShelf()
        """Modules of destroyed kernels, kept for the next loads of their images."""
        self.staged: dict[int, deque[tuple[Any, int, int]]] = {}
        """Per stream (by handle id), the staging blocks of its queued host-to-device
        copies, each with the marker recorded after its copy, oldest first."""
        self.stranded: list[tuple[int, int]] = []
        """Staging blocks whose marker could not be recorded: pooled when the backend closes."""
        self.reactor = CompletionReactor(context, poison, poll_interval=poll_interval)
        self._markers: list[Any] = []
        self._markers_lock = threading.Lock()
        self.trace_clock = TraceClock(self.check, self.bound)
        """Device times of traced work (idle, holding nothing, until something is traced)."""

    # ----- ledgers and records -------------------------------------------------------------

    def track(self, stream_id: int) -> None:
        """Start a ledger for a new stream."""
        self.ledgers[stream_id] = Ledger(self.forecast)

    def ledger(self, stream: StreamHandle) -> Ledger:
        """The forecast's ledger of ``stream``'s work."""
        return self.ledgers[stream.id]

    def record(self, event: EventHandle, stream: StreamHandle) -> None:
        """Record ``event`` on ``stream`` and remember where, for its forecast and watch."""
        self.check(driver().cuEventRecord(event.native, stream.native), "recording an event")
        self.records[event.id] = Record(stream.native, self.ledgers[stream.id])

    def wait(self, stream: StreamHandle, event: EventHandle) -> None:
        """Make ``stream`` wait on the device for ``event``'s latest record."""
        self.check(
            driver().cuStreamWaitEvent(stream.native, event.native, 0), "waiting for an event"
        )
        record = self.records.get(event.id)
        if record is not None:
            self.ledgers[stream.id].enqueue_wait(record.ledger, record.position)

    # ----- device memory -------------------------------------------------------------------

    def allocate(self, size: int, action: str) -> int:
        """``cuMemAlloc`` of ``size`` bytes (the context current); raises as ``action`` failing.

        Out of memory, it frees the blocks kept for reuse and tries once more:
        the kept blocks are never the reason an allocation fails. Those frees
        run here, on the event loop's thread, as a last resort: each waits for
        the device.
        """
        d = driver()
        result, pointer = d.cuMemAlloc(size)
        if result == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY and self.blocks.held:
            for base in self.blocks.drain():
                d.cuMemFree(base)
            result, pointer = d.cuMemAlloc(size)
        return int(self.value((result, pointer), action))

    # ----- staging memory ------------------------------------------------------------------

    def take_staging(self, size: int) -> tuple[int, int]:
        """A pinned block for ``size`` bytes, ``(pointer, capacity)``.

        The blocks of copies that have landed go back to the pool first.
        """
        if self.staged:
            self._reclaim_staged()
        return self.staging.take(size, self.bound)

    def stage_until_copied(self, stream: StreamHandle, host: int, capacity: int) -> None:
        """Give ``host`` back to the pool once the copy just queued on ``stream`` has landed.

        A marker is recorded after the copy and queried the next time staging
        memory is taken: no thread is woken for it. Should the record fail,
        the block is kept until the backend closes (the copy may still read it).
        """
        try:
            marker = self.take_marker()
        except BaseException:
            self.stranded.append((host, capacity))
            raise
        (result,) = driver().cuEventRecord(marker, stream.native)
        if int(result):
            self.recycle_marker(marker)
            self.stranded.append((host, capacity))
            self.fail(result, "recording a marker")
        queued = self.staged.get(stream.id)
        if queued is None:
            queued = self.staged[stream.id] = deque()
        queued.append((marker, host, capacity))

    def _reclaim_staged(self) -> None:
        """Pool the blocks of landed copies, each stream's oldest first.

        One stream's markers complete in order, so a busy stream holds back only its own.
        """
        query, success, not_ready = driver().cuEventQuery, self.success, self.not_ready
        for stream_id, queued in list(self.staged.items()):
            while queued:
                marker, host, capacity = queued[0]
                (result,) = query(marker)
                if result != success:
                    if result != not_ready:
                        self.fail(result, "querying a copy's marker")
                    break
                queued.popleft()
                self.recycle_marker(marker)
                self.staging.give_back(host, capacity)
            if not queued:
                del self.staged[stream_id]

    def release_staged(self) -> None:
        """Every staged block back to the pool (the backend drained its streams, or died)."""
        staged, self.staged = self.staged, {}
        stranded, self.stranded = self.stranded, []
        for queued in staged.values():
            for marker, host, capacity in queued:
                self.recycle_marker(marker)
                self.staging.give_back(host, capacity)
        for host, capacity in stranded:
            self.staging.give_back(host, capacity)

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The backend's context current on this thread within the block, the previous after.

        Around each driver call that makes something in the current context
        (memory, streams, events, graphs, pinned blocks): another library, or
        a backend of another device, may have made its own current on this
        thread, and finds it current again after. Calls on existing objects
        (launches, copies, records on a stream, queries) act in their objects'
        context and need no binding. One driver call when the context is
        current already (the usual case), three otherwise.
        """
        d = driver()
        if int(d.cuCtxGetCurrent()[1]) == self.context_address:
            yield
            return
        self.check(d.cuCtxPushCurrent(self.context), "making the context current")
        try:
            yield
        finally:
            d.cuCtxPopCurrent()

    # ----- markers -------------------------------------------------------------------------

    def take_marker(self) -> Any:
        """A pooled event (no timing) for the backend's own completion markers."""
        with self._markers_lock:
            if self._markers:
                return self._markers.pop()
        with self.bound():
            return self.value(driver().cuEventCreate(self.event_flags), "creating an event")

    def recycle_marker(self, native: Any) -> None:
        """Give a marker back once the device is past its record (from any thread)."""
        with self._markers_lock:
            if len(self._markers) < _MARKER_POOL_SIZE:
                self._markers.append(native)
                return
        driver().cuEventDestroy(native)

    @property
    def pooled_markers(self) -> int:
        """How many marker events wait in the pool for reuse."""
        with self._markers_lock:
            return len(self._markers)

    def destroy_markers(self) -> None:
        """Destroy the pooled markers (the backend is closing)."""
        with self._markers_lock:
            markers, self._markers = self._markers, []
        d = driver()
        for marker in markers:
            d.cuEventDestroy(marker)
