"""Waking a task at a precise instant, from its own event loop's thread.

:func:`accy_async.waiting.wait_event` sleeps until shortly before a kernel is
due to finish and then watches it from the event loop. That needs a sleep far
finer than the loops' own timers (``epoll_wait`` takes milliseconds), and a
wake-up that does not come from another thread: on virtual machines a thread
that wakes a sleeping loop pays an inter-processor interrupt through the
hypervisor, tens to hundreds of microseconds (``benchmarks/results/``).

On Linux every event loop therefore gets one ``timerfd`` (nanosecond deadlines
on ``CLOCK_MONOTONIC``, the clock of :func:`time.perf_counter`) that the
loop's own selector watches: asyncio and uvloop through ``add_reader``, trio
through a system task in ``wait_readable``. Elsewhere one shared thread with a
fine timer slack fires the alarms and wakes the loop the usual way.

Each clock learns how late its alarms land (:attr:`AlarmClock.margin`), so a
caller can ask to be woken that much early.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import itertools
import os
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any, Final

import sniffio

__all__ = ["Alarm", "AlarmClock", "alarm_clock"]

Callback = Callable[[], None]

_LATENESS_LIMIT: Final = 2e-3
"""Lateness samples are clipped here, so one preempted wake-up does not dominate the margin."""


class Alarm:
    """One scheduled callback; :meth:`cancel` withdraws it (on the thread that scheduled it)."""

    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callback) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        """Make sure the callback will not run (unless it is running already)."""
        self.cancelled = True


class AlarmClock(ABC):
    """Fires callbacks at :func:`time.perf_counter` instants and learns how late they land."""

    def __init__(self) -> None:
        # A smoothed mean and mean deviation of the lateness, as TCP smooths round trips.
        self._late_mean = 20e-6
        self._late_deviation = 10e-6

    @abstractmethod
    def schedule(self, when: float, callback: Callback) -> Alarm:
        """Call ``callback`` at ``when`` (at once if it has passed).

        Call this from the event loop's thread. Where the callback runs
        depends on the clock: on the loop's thread for the timerfd clocks, on
        the clock's own thread otherwise; it must be cheap and thread-safe.
        """

    @abstractmethod
    async def sleep_until(self, when: float) -> None:
        """Sleep until ``when``; call it from the loop this clock belongs to."""

    @property
    def margin(self) -> float:
        """How much earlier than needed to ask for a wake-up: most alarms land within it."""
        return min(max(self._late_mean + 3 * self._late_deviation, 5e-6), 1e-3)

    def observe_lateness(self, seconds: float) -> None:
        """Fold in how late a task resumed after a short sleep it asked for."""
        sample = min(max(seconds, 0.0), _LATENESS_LIMIT)
        error = sample - self._late_mean
        self._late_mean += error / 8
        self._late_deviation += (abs(error) - self._late_deviation) / 4

    def missed_a_sleep(self) -> None:
        """A wait found no time to sleep within the margin: shrink the margin a little.

        Without samples the margin would never come down again after a burst
        of late wake-ups, and short waits would poll all the time.
        """
        self._late_mean *= 0.97
        self._late_deviation *= 0.97


# ----- the timerfd clocks -----------------------------------------------------------------


class _Timerfd:
    """A non-blocking ``CLOCK_MONOTONIC`` timerfd armed at absolute deadlines."""

    def __init__(self) -> None:
        create = getattr(os, "timerfd_create", None)  # Python 3.13+
        if create is not None:
            self.fd: int = create(time.CLOCK_MONOTONIC, flags=os.O_NONBLOCK | os.O_CLOEXEC)
            self._settime_ns: Any = getattr(os, "timerfd_settime_ns")  # noqa: B009
            self._spec: Any = None
            return
        libc = _libc()
        fd = libc.timerfd_create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        self._settime_ns = None
        self._spec = _ITimerSpec()
        self._settime = libc.timerfd_settime

    def arm(self, when: float) -> None:
        """Make the descriptor readable at ``when`` (a :func:`time.perf_counter` instant)."""
        nanoseconds = max(int(when * 1e9), 1)  # zero would disarm
        if self._settime_ns is not None:
            self._settime_ns(self.fd, flags=_TFD_TIMER_ABSTIME, initial=nanoseconds)
            return
        spec = self._spec
        spec.value_seconds, spec.value_nanoseconds = divmod(nanoseconds, 1_000_000_000)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)


_TFD_TIMER_ABSTIME: Final = 1


class _ITimerSpec(ctypes.Structure):
    _fields_ = (
        ("interval_seconds", ctypes.c_long),
        ("interval_nanoseconds", ctypes.c_long),
        ("value_seconds", ctypes.c_long),
        ("value_nanoseconds", ctypes.c_long),
    )


_libc_instance: Any = None


def _libc() -> Any:
    global _libc_instance
    if _libc_instance is None:
        _libc_instance = ctypes.CDLL(None, use_errno=True)
    return _libc_instance


def _timerfd_usable() -> bool:
    return (
        sys.platform == "linux"
        and time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    )


class _TimerfdClock(AlarmClock):
    """Alarms of one event loop, fired on its thread when its timerfd becomes readable."""

    def __init__(self, timer: _Timerfd) -> None:
        super().__init__()
        self._timer = timer
        self._heap: list[tuple[float, int, Alarm]] = []
        self._sequence = itertools.count()
        self._armed_for: float | None = None

    def schedule(self, when: float, callback: Callback) -> Alarm:
        alarm = Alarm(callback)
        heapq.heappush(self._heap, (when, next(self._sequence), alarm))
        if self._armed_for is None or when < self._armed_for:
            self._armed_for = when
            self._timer.arm(when)
        return alarm

    def fire_due(self) -> None:
        """The timerfd is readable: run every alarm that is due and re-arm for the next."""
        self._timer.clear()
        self._armed_for = None
        heap = self._heap
        now = time.perf_counter()
        due: list[Alarm] = []
        while heap and (heap[0][0] <= now or heap[0][2].cancelled):
            due.append(heapq.heappop(heap)[2])
        if heap:  # re-armed first: a failing callback cannot strand the later alarms
            self._armed_for = heap[0][0]
            self._timer.arm(self._armed_for)
        for alarm in due:
            if not alarm.cancelled:
                alarm.callback()


class _AsyncioTimerfdClock(_TimerfdClock):
    """Holds no reference to its loop: the loop's finalizer closes the timerfd."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        timer = _Timerfd()
        super().__init__(timer)
        self.close = weakref.finalize(loop, os.close, timer.fd)
        try:
            loop.add_reader(timer.fd, self.fire_due)
        except BaseException:
            self.close()
            raise

    async def sleep_until(self, when: float) -> None:
        future = asyncio.get_running_loop().create_future()
        alarm = self.schedule(when, partial(_set_result, future))
        try:
            await future
        finally:
            alarm.cancel()


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _TrioTimerfdClock(_TimerfdClock):
    def __init__(self) -> None:
        import trio

        timer = _Timerfd()
        super().__init__(timer)
        trio.lowlevel.spawn_system_task(self._serve, name="accy_async.alarms")

    async def sleep_until(self, when: float) -> None:
        import trio

        task = trio.lowlevel.current_task()
        alarm = self.schedule(when, partial(trio.lowlevel.reschedule, task))

        def abort(raise_cancel: Any) -> Any:
            del raise_cancel
            alarm.cancel()  # the alarm fires on this thread: it cannot be running now
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def _serve(self) -> None:
        import trio

        try:
            while True:
                await trio.lowlevel.wait_readable(self._timer.fd)
                self.fire_due()
        finally:
            os.close(self._timer.fd)


# ----- the thread clock (anywhere) --------------------------------------------------------


class _ThreadClock(AlarmClock):
    """One thread for all loops; its timer slack is cut to a nanosecond on Linux."""

    def __init__(self) -> None:
        super().__init__()
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._sequence = itertools.count()
        self._thread = threading.Thread(target=self._run, name="accy-alarm-clock", daemon=True)
        self._thread.start()

    def schedule(self, when: float, callback: Callback) -> Alarm:
        alarm = Alarm(callback)
        with self._condition:
            heapq.heappush(self._heap, (when, next(self._sequence), alarm))
            self._condition.notify()
        return alarm

    async def sleep_until(self, when: float) -> None:
        from .waiting import CompletionLatch  # the thread-safe way to wake a task

        woken = CompletionLatch()
        alarm = self.schedule(when, partial(woken, None))
        try:
            await woken.wait()
        finally:
            alarm.cancel()

    def _run(self) -> None:
        if sys.platform == "linux":
            with contextlib.suppress(Exception):  # not allowed: coarser sleeps
                _libc().prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
        while True:
            with self._condition:
                while not self._heap:
                    self._condition.wait()
                delay = self._heap[0][0] - time.perf_counter()
                if delay > 0:
                    self._condition.wait(delay)
                    continue
                _, _, alarm = heapq.heappop(self._heap)
            if not alarm.cancelled:
                alarm.callback()


_thread_clock: _ThreadClock | None = None
_thread_clock_lock = threading.Lock()


def _shared_thread_clock() -> _ThreadClock:
    global _thread_clock
    with _thread_clock_lock:
        if _thread_clock is None:
            _thread_clock = _ThreadClock()
        return _thread_clock


# ----- one clock per loop -----------------------------------------------------------------

_asyncio_clocks: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AlarmClock]] = (
    weakref.WeakKeyDictionary()
)
_trio_clock_var: Any = None


def alarm_clock() -> AlarmClock:
    """The alarm clock of the running event loop (created on first use).

    Call it from inside the loop. A closed loop's timerfd is closed when the
    loop is collected, or when the next loop asks for a clock.
    """
    if sniffio.current_async_library() == "trio":
        return _trio_clock()
    loop = asyncio.get_running_loop()
    clock = _asyncio_clocks.get(loop)
    if clock is None:
        for other, old in list(_asyncio_clocks.items()):
            if other.is_closed() and isinstance(old, _AsyncioTimerfdClock):
                old.close()
                del _asyncio_clocks[other]
        clock = _shared_thread_clock()
        if _timerfd_usable():
            with contextlib.suppress(OSError, NotImplementedError):
                clock = _AsyncioTimerfdClock(loop)
        _asyncio_clocks[loop] = clock
    return clock


def _trio_clock() -> AlarmClock:
    import trio

    global _trio_clock_var
    if _trio_clock_var is None:
        _trio_clock_var = trio.lowlevel.RunVar("accy_async_alarm_clock")
    try:
        clock: AlarmClock = _trio_clock_var.get()
    except LookupError:
        clock = _shared_thread_clock()
        if _timerfd_usable():
            with contextlib.suppress(OSError):
                clock = _TrioTimerfdClock()
        _trio_clock_var.set(clock)
    return clock
