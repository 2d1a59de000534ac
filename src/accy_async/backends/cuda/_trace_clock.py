"""Device times for traces on CUDA: a timing event before and after each traced operation.

A traced launch (or copy, fill, read) records a timing event on its stream
before and after it; the event completes when the stream reaches it, so the
pair brackets the work on the device. The times become the host's clock
through a reference: an event recorded on a stream of the clock's own, which
is idle, and waited for at once (the only time tracing blocks: three such
windows of a few microseconds on the first stamp, the tightest kept). An
event's host time is then the reference's plus
``cuEventElapsedTime(reference, event)`` (about half a microsecond of
resolution while the reference is young: the call returns float
milliseconds).

Stamps are resolved when the trace is exported (:meth:`Tracer.chrome_trace`
calls :meth:`TraceClock.resolve`): a completed event gives its record its
device time and goes back to the pool; one not yet completed stays pending
and its record shows the host's side only. Once every stamp is resolved the
reference is let go, and the next stamp takes a fresh one. A long trace
recycles the events the device has passed when the pool runs dry, so steady
tracing creates no events. Every event is destroyed once, when the backend
closes.
"""

from __future__ import annotations

import time
from typing import Any

from .._trace import Tracer, TraceRecord
from .driver import driver

__all__ = ["TraceClock"]

_RECYCLE_AT = 256
"""Pending stamps past which a stamp with no free event resolves those already reached."""


class TraceClock:
    """Timing events that give traced records their device times; see the module docstring.

    Used from the event loop's thread only (stamps and exports both run there).
    """

    __slots__ = (
        "_bound",
        "_check",
        "_collect_at",
        "_count",
        "_driver",
        "_free",
        "_pending",
        "_reference",
        "_stream",
        "_tracer",
    )

    def __init__(self, check: Any, bound: Any) -> None:
        self._check = check
        """The backend's driver-result check (raises, poisoning the backend on a fault)."""
        self._bound = bound
        """``with bound():`` the backend's context is current (to create events and the stream)."""
        self._driver = driver()
        self._free: list[Any] = []
        self._pending: dict[int, list[tuple[Any, TraceRecord, bool]]] = {}
        """Stamps not yet resolved, by stream, oldest first: a stream passes them in order."""
        self._count = 0
        """How many stamps are pending, on every stream."""
        self._collect_at = _RECYCLE_AT
        self._reference: tuple[Any, int] | None = None
        self._stream: Any = None
        self._tracer: Tracer | None = None
        """The tracer this clock last resolved for (it asks each new one to call it)."""

    def stamp(self, stream: Any, record: TraceRecord, end: bool, tracer: Tracer) -> None:
        """Record an event on ``stream`` (a raw stream) for ``record``'s device start or end.

        ``tracer`` holds ``record``: the first stamp for a tracer has it call
        :meth:`resolve` before each export.
        """
        if tracer is not self._tracer:
            tracer.add_resolver(self.resolve)
            self._tracer = tracer
        if self._reference is None:
            self._reference = self._take_reference()
        free = self._free
        if not free and self._count >= self._collect_at:
            self._collect()  # a long trace not yet exported: reuse the events already reached
            # A device far behind frees nothing: look again only when twice as many wait.
            self._collect_at = max(_RECYCLE_AT, 2 * self._count)
        event = free.pop() if free else self._new_event()
        try:
            self._check(self._driver.cuEventRecord(event, stream), "recording a trace event")
        except BaseException:
            free.append(event)  # still the pool's: destroyed at close
            raise
        queue = self._pending.get(record.stream)
        if queue is None:
            queue = self._pending[record.stream] = []
        queue.append((event, record, end))
        self._count += 1

    def resolve(self) -> None:
        """Give each completed stamp's record its device time (nanoseconds, host clock).

        When every stamp is resolved the reference is let go, so the next trace
        takes a fresh one (``cuEventElapsedTime``'s float milliseconds coarsen
        as the reference ages).
        """
        self._collect()
        if not self._count:
            self._collect_at = _RECYCLE_AT
            if self._reference is not None:
                self._free.append(self._reference[0])
                self._reference = None

    def _collect(self) -> None:
        """Resolve the stamps the device has reached; their events go back to the pool.

        A stream reaches its stamps in the order they were recorded, so each
        stream's queue is a reached prefix and an unreached rest: one query of
        the newest stamp finds the usual case (all reached), a binary search
        the others.
        """
        if self._reference is None or not self._count:
            return
        d = self._driver
        query, elapsed = d.cuEventQuery, d.cuEventElapsedTime
        reference, reference_ns = self._reference
        free = self._free
        for key, queue in list(self._pending.items()):
            if not int(query(queue[-1][0])[0]):
                reached = len(queue)
            else:  # the first stamp not reached (a failed query counts as not reached)
                low, high = 0, len(queue) - 1
                while low < high:
                    middle = (low + high) // 2
                    if int(query(queue[middle][0])[0]):
                        high = middle
                    else:
                        low = middle + 1
                reached = low
            done = queue[:reached]
            if reached == len(queue):
                del self._pending[key]
            else:
                del queue[:reached]
            self._count -= reached
            free.extend(event for event, _, _ in done)  # the pool's before anything can raise
            for event, record, end in done:
                result, milliseconds = elapsed(reference, event)
                if int(result):
                    continue
                at = reference_ns + round(milliseconds * 1e6)
                if end:
                    record.device_end_ns = at
                else:
                    record.device_start_ns = at

    def close(self) -> None:
        """Destroy every event and the clock's stream (the backend is closing)."""
        d = self._driver
        events = [*self._free]
        for queue in self._pending.values():
            events.extend(event for event, _, _ in queue)
        if self._reference is not None:
            events.append(self._reference[0])
        self._free, self._pending, self._count, self._collect_at = [], {}, 0, _RECYCLE_AT
        self._reference, self._tracer = None, None
        for event in events:
            d.cuEventDestroy(event)
        if self._stream is not None:
            d.cuStreamDestroy(self._stream)
            self._stream = None

    def _new_event(self) -> Any:
        with self._bound():
            result, event = self._driver.cuEventCreate(0)  # CU_EVENT_DEFAULT: timing enabled
        self._check(result, "creating a trace event")
        return event

    def _take_reference(self) -> tuple[Any, int]:
        """An event the device reached at a known host time: recorded on an idle stream.

        The host time is the middle of the tightest of three record-and-wait
        windows (each a few microseconds).
        """
        d = self._driver
        if self._stream is None:
            with self._bound():
                result, stream = d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._check(result, "creating the trace clock's stream")
            self._stream = stream
        best: tuple[int, Any, int] | None = None  # (window, event, host time)
        for _ in range(3):
            event = self._new_event()
            self._free.append(event)  # the pool's from now on: destroyed at close
            before = time.perf_counter_ns()
            self._check(d.cuEventRecord(event, self._stream), "recording the trace reference")
            self._check(d.cuEventSynchronize(event), "waiting for the trace reference")
            after = time.perf_counter_ns()
            if best is None or after - before < best[0]:
                best = (after - before, event, (before + after) // 2)
        assert best is not None
        self._free.remove(best[1])
        return (best[1], best[2])
