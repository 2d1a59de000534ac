"""Alarm clocks: callbacks at precise :func:`time.perf_counter` instants.

The event loops' own timers are millisecond-grained (``epoll_wait`` takes
milliseconds), and on virtual machines a thread that wakes a sleeping loop
pays an inter-processor interrupt through the hypervisor, tens to hundreds of
microseconds. So on Linux every event loop gets a :class:`TimerfdClock`: one
``timerfd`` on ``CLOCK_MONOTONIC`` (the clock of ``perf_counter``) with
nanosecond deadlines, watched by the loop's own selector (the loop modules
wire it: ``add_reader`` on asyncio, a system task on trio), so alarms fire on
the loop's thread. Elsewhere one shared :class:`ThreadClock` fires them from
a thread with its timer slack cut to a nanosecond.

Each clock learns how late its wake-ups land (:attr:`AlarmClock.margin`), so
a caller can ask to be woken that much early.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Final

from ..backends._completion import CompletionRegistration

__all__ = [
    "Alarm",
    "AlarmClock",
    "Callback",
    "ThreadClock",
    "TimerfdClock",
    "shared_thread_clock",
    "timerfd_usable",
]

Callback = Callable[[], None]

_MARGIN_BOUNDS: Final = (5e-6, 1e-3)
"""The smallest and largest margin a clock gives."""

_LATE_GROWTH: Final = 1.2
"""A wake-up later than the margin raises it by this factor (at most: one preempted wake-up,
milliseconds late, must not make every later wait spin for a millisecond)..."""

_ON_TIME_DECAY: Final = 0.978
"""... and one within it lowers it by this one. At balance the margin is the lateness that
about one wake-up in nine exceeds (ln 0.978 / (ln 0.978 - ln 1.2) = 0.11)."""


class Alarm(CompletionRegistration):
    """One scheduled callback; :meth:`cancel` withdraws it (on the thread that scheduled it)."""

    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callback) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> bool:
        """Make sure the callback will not run (unless it is running already).

        Returns ``True``, so an alarm is a completion registration (see
        :meth:`~accy_async._loops.Loop.wait`).
        """
        self.cancelled = True
        return True


class AlarmClock(ABC):
    """Fires callbacks at :func:`time.perf_counter` instants and learns how late they land."""

    def __init__(self) -> None:
        # A running estimate of the lateness's 89th percentile: it moves by a bounded factor
        # per sample, so an outlier moves it little; a lasting rise is followed within about
        # a dozen samples (x1.2 each), a lasting fall more slowly (about 170 samples to come
        # down from 1 ms to 25 us), as on-time samples are the many.
        self._late = 20e-6

    @abstractmethod
    def schedule(self, when: float, callback: Callback) -> Alarm:
        """Call ``callback`` at ``when`` (at once if it has passed).

        Call this from the event loop's thread. Where the callback runs
        depends on the clock: on the loop's thread for :class:`TimerfdClock`,
        on the clock's own thread for :class:`ThreadClock`; it must be cheap
        and thread-safe.
        """

    @property
    def fires_on_loop_thread(self) -> bool:
        """Whether callbacks run on the event loop's own thread."""
        return False

    @property
    def margin(self) -> float:
        """How much earlier than needed to ask for a wake-up: about 9 alarms in 10 land within it.

        A wait that wakes this early polls until its work is due, so the margin
        is what a wait spends spinning to be on time; the one wake-up in ten
        that lands later costs that wait its lateness instead.
        """
        low, high = _MARGIN_BOUNDS
        return min(max(self._late, low), high)

    def observe_lateness(self, seconds: float) -> None:
        """Fold in how late a task resumed after a short sleep it asked for (early is on time)."""
        low, high = _MARGIN_BOUNDS
        if seconds > self._late:
            self._late = min(max(self._late, low) * _LATE_GROWTH, high)
        else:
            self._late = max(self._late * _ON_TIME_DECAY, low)

    def missed_a_sleep(self) -> None:
        """A wait found no time to sleep within the margin: shrink the margin a little.

        Without samples the margin would never come down again after a burst
        of late wake-ups, and short waits would poll all the time.
        """
        self._late = max(self._late * 0.97, _MARGIN_BOUNDS[0])


# ----- the timerfd clock ------------------------------------------------------------------


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
        """Consume the expiry so the descriptor is no longer readable."""
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


def timerfd_usable() -> bool:
    """Whether a timerfd shares :func:`time.perf_counter`'s clock here (Linux)."""
    return (
        sys.platform == "linux"
        and time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    )


class TimerfdClock(AlarmClock):
    """Alarms of one event loop, fired on its thread when its timerfd becomes readable.

    The loop watches :attr:`timer`'s descriptor and calls :meth:`fire_due`
    when it is readable; whoever wires it closes the descriptor.
    """

    def __init__(self) -> None:
        super().__init__()
        self.timer = _Timerfd()
        self._heap: list[tuple[float, int, Alarm]] = []
        """Pending alarms; the timerfd is armed for the first one's instant."""
        self._sequence = itertools.count()

    @property
    def fires_on_loop_thread(self) -> bool:
        """Always: the loop's own selector reports the timerfd."""
        return True

    def schedule(self, when: float, callback: Callback) -> Alarm:
        """Call ``callback`` on the loop's thread at ``when``."""
        alarm = Alarm(callback)
        heap = self._heap
        if not heap or when < heap[0][0]:
            self.timer.arm(when)
        heapq.heappush(heap, (when, next(self._sequence), alarm))
        return alarm

    def fire_due(self) -> None:
        """The timerfd is readable: run every alarm that is due and re-arm for the next."""
        self.timer.clear()
        heap = self._heap
        now = time.perf_counter()
        due: list[Alarm] = []
        while heap and (heap[0][0] <= now or heap[0][2].cancelled):
            due.append(heapq.heappop(heap)[2])
        if heap:  # re-armed first: a failing callback cannot strand the later alarms
            self.timer.arm(heap[0][0])
        for alarm in due:
            if not alarm.cancelled:
                alarm.callback()


# ----- the thread clock (anywhere) --------------------------------------------------------


class ThreadClock(AlarmClock):
    """One thread for all loops; its timer slack is cut to a nanosecond on Linux."""

    def __init__(self) -> None:
        super().__init__()
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._sequence = itertools.count()
        self._thread = threading.Thread(target=self._run, name="accy-alarm-clock", daemon=True)
        self._thread.start()

    def schedule(self, when: float, callback: Callback) -> Alarm:
        """Call ``callback`` on the clock's thread at ``when``."""
        alarm = Alarm(callback)
        with self._condition:
            heapq.heappush(self._heap, (when, next(self._sequence), alarm))
            self._condition.notify()
        return alarm

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


_thread_clock: ThreadClock | None = None
_thread_clock_lock = threading.Lock()


def shared_thread_clock() -> ThreadClock:
    """The one :class:`ThreadClock` of the process (started on first use)."""
    global _thread_clock
    with _thread_clock_lock:
        if _thread_clock is None:
            _thread_clock = ThreadClock()
        return _thread_clock
