"""What the library keeps per running event loop, whatever the loop's library."""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, Final, Generic, TypeAlias, TypeVar

from ..backends._completion import CompletionCallback, CompletionRegistration
from ..errors import AccyError
from ._clock import AlarmClock, TimerfdClock, shared_thread_clock, timerfd_usable

__all__ = ["ADMITTED_PER_PASS", "WAKE_CHUNK", "Bridge", "Loop", "Register", "fresh_error"]

ADMITTED_PER_PASS: Final = 1
"""Launches let through per pass of the loop (see :meth:`Loop.admit`).

One: a request's host work (checking, packing, enqueueing its kernels and
its read) runs 0.2-0.6 ms in Python, and a timer can wait two passes, so
four a pass let a 64-task service delay a 1 ms heartbeat by 4 ms (H200).
A pass costs a few microseconds, little beside a launch."""

WAKE_CHUNK: Final = 8
"""Most waiters one wake-up resumes; a larger burst is spread over loop iterations, so that
timers and other tasks run between the chunks (a resumed task may go on to heavy work)."""

_W = TypeVar("_W")

Register: TypeAlias = Callable[[CompletionCallback], CompletionRegistration]
"""Hands a callback to a backend and returns its registration (see :meth:`Loop.wait`)."""


class Bridge(ABC, Generic[_W]):
    """Delivers completions to one event loop from any thread.

    On the loop's own thread a completion wakes its waiter at once. From
    elsewhere, completions that arrive together cost the loop one thread-safe
    wake-up, and a large burst is resumed :data:`WAKE_CHUNK` at a time.
    Subclasses say how a waiter is woken and how a callback reaches the loop.
    """

    __slots__ = ("_batch", "_lock", "_scheduled", "_thread_id")

    def __init__(self) -> None:
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._batch: deque[tuple[_W, BaseException | None]] = deque()
        self._scheduled = False

    def deliver(self, waiter: _W, error: BaseException | None) -> None:
        """Wake ``waiter`` (with ``error``, if any); from any thread."""
        if threading.get_ident() == self._thread_id:
            self._wake(waiter, error)
            return
        with self._lock:
            self._batch.append((waiter, error))
            if self._scheduled:
                return
            self._scheduled = True
        self._post_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch = self._batch
            chunk = [batch.popleft() for _ in range(min(WAKE_CHUNK, len(batch)))]
            more = bool(batch)
            self._scheduled = more
        for waiter, error in chunk:
            self._wake(waiter, error)
        if more:  # let timers and other tasks run between chunks
            self._post_soon(self._drain)

    @abstractmethod
    def _wake(self, waiter: _W, error: BaseException | None) -> None:
        """Resume ``waiter``; on the loop's thread."""

    @abstractmethod
    def _post_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon; from any thread (nothing if the loop is gone)."""

    @abstractmethod
    def _post_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on a later pass of the loop; from the loop's thread."""


class Loop(ABC):
    """The library's state for one running event loop (asyncio, uvloop or a trio run).

    Use it only from the loop's own thread.
    """

    __slots__ = ("_clock", "_tokens", "watchers")

    def __init__(self) -> None:
        self.watchers = 0
        """How many waits of this loop are watching their work themselves right now."""
        self._tokens = ADMITTED_PER_PASS
        """Admission tokens not held (see :meth:`admit`)."""
        self._clock: AlarmClock | None = None

    @property
    def clock(self) -> AlarmClock:
        """The loop's alarm clock: precise wake-ups, on the loop's thread where possible.

        A timerfd watched by the loop itself where there is one (made on first
        use), else the process's shared thread clock.
        """
        clock = self._clock
        if clock is None:
            if timerfd_usable():
                with contextlib.suppress(OSError, NotImplementedError):
                    clock = self._timerfd_clock()
            if clock is None:
                clock = shared_thread_clock()
            self._clock = clock
        return clock

    @abstractmethod
    def _timerfd_clock(self) -> TimerfdClock:
        """A timerfd clock wired to this loop.

        Raises :class:`OSError` or :class:`NotImplementedError` where that cannot be done.
        """

    @abstractmethod
    def checkpoint(self) -> Awaitable[None]:
        """The cheapest yield that honours cancellation on this loop."""

    @abstractmethod
    def admit(self) -> Awaitable[None]:
        """The checkpoint that starts a launch: fair to the loop when many tasks launch at once.

        At most :data:`ADMITTED_PER_PASS` launches are let through per pass of
        the loop (between two runs of its timers); later ones wait, in order,
        for a later pass. A launch does its checking and enqueueing in one go
        after this checkpoint, so a crowd of tasks launching together would
        otherwise hold the loop (and every timer) for all of theirs at once.
        """

    @property
    def free_admissions(self) -> int:
        """Admission tokens not held: :data:`ADMITTED_PER_PASS` when no launch is being admitted."""
        return self._tokens

    @abstractmethod
    def wait(self, register: Register) -> Coroutine[Any, Any, None]:
        """Await the callback that ``register`` hands to a backend.

        The callback may fire on any thread, or at once inside ``register``;
        either way the wait is a checkpoint. Cancelling it withdraws the
        callback. An error the callback carries is raised as a fresh copy
        (:func:`fresh_error`), chained to the original.
        """

    def sleep_until(self, when: float) -> Coroutine[Any, Any, None]:
        """Sleep until the :func:`time.perf_counter` instant ``when`` on the loop's clock.

        A wait (:meth:`wait`) for an alarm: cancelling it withdraws the alarm.
        """
        clock = self.clock
        return self.wait(lambda callback: clock.schedule(when, partial(callback, None)))


def fresh_error(error: BaseException) -> BaseException:
    """A new exception for one waiter, so concurrent raisers don't share a traceback."""
    if isinstance(error, AccyError):
        copy = type(error).__new__(type(error))
        AccyError.__init__(copy, error.message, path=error.path)
        copy.__cause__ = error
        return copy
    return error
