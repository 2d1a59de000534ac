"""The asyncio (and uvloop) side of the loop layer.

* A completion that fires on another thread reaches its task through the
  loop's :class:`_Bridge`: completions that arrive together cost one
  ``call_soon_threadsafe``, and a large burst is resumed in chunks so timers
  and other tasks run between them.
* The loop's alarm clock is a timerfd that the loop's own selector watches
  (``add_reader``), so an alarm wakes the loop from its own thread.
* The checkpoint is a bare yield: one loop iteration, and a pending
  cancellation (asyncio's or an AnyIO scope's) is raised there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Coroutine, Generator
from functools import partial
from typing import Any, Final

from ._base import ADMITTED_PER_PASS, Loop, Register, fresh_error
from ._clock import AlarmClock, TimerfdClock, shared_thread_clock, timerfd_usable

__all__ = ["YIELD", "AsyncioLoop", "current_asyncio_loop"]

WAKE_CHUNK: Final = 8
"""Most waiters one wake-up resumes; a larger burst is spread over loop iterations, so that
timers and other tasks run between the chunks (a resumed task may go on to heavy work)."""


class _Yield:
    """``await YIELD`` gives the loop one iteration (asyncio runs a bare ``yield`` so)."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield


YIELD: Final = _Yield()


class _Bridge:
    """Delivers completions to one asyncio loop, one thread-safe wake-up per batch."""

    __slots__ = ("_batch", "_lock", "_loop", "_scheduled", "_thread_id")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop's state must not keep the loop alive
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._batch: list[tuple[asyncio.Future[None], BaseException | None]] = []
        self._scheduled = False

    def deliver(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        if threading.get_ident() == self._thread_id:
            _resolve(future, error)
            return
        with self._lock:
            self._batch.append((future, error))
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._batch = self._batch[:WAKE_CHUNK], self._batch[WAKE_CHUNK:]
            more = bool(self._batch)
            self._scheduled = more
        for future, error in batch:
            _resolve(future, error)
        loop = self._loop()
        if more and loop is not None:  # let timers and other tasks run between chunks
            loop.call_soon(self._drain)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(fresh_error(error))


class _Delivery:
    """The callback of one wait (one object, where a closure would take five)."""

    __slots__ = ("_bridge", "_future")

    def __init__(self, bridge: _Bridge, future: asyncio.Future[None]) -> None:
        self._bridge = bridge
        self._future = future

    def __call__(self, error: BaseException | None) -> None:
        self._bridge.deliver(self._future, error)


class AsyncioLoop(Loop):
    """The library's state for one asyncio loop; holds no reference to the loop itself."""

    __slots__ = (
        "__weakref__",
        "_admitted",
        "_bridge",
        "_clock",
        "_close_timer",
        "_next_pass_scheduled",
        "_queued",
        "loop",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = weakref.ref(loop)
        self._bridge = _Bridge(loop)
        self._clock: AlarmClock | None = None
        self._close_timer: Any = None
        self._admitted = 0
        self._queued: deque[asyncio.Future[None]] = deque()
        self._next_pass_scheduled = False

    @property
    def clock(self) -> AlarmClock:
        """The loop's timerfd clock (watched with ``add_reader``), made on first use."""
        clock = self._clock
        if clock is None:
            clock = shared_thread_clock()
            loop = self.loop()
            if loop is not None and timerfd_usable():
                with contextlib.suppress(OSError, NotImplementedError):
                    clock = self._timerfd_clock(loop)
            self._clock = clock
        return clock

    def _timerfd_clock(self, loop: asyncio.AbstractEventLoop) -> TimerfdClock:
        clock = TimerfdClock()
        fd = clock.timer.fd
        self._close_timer = weakref.finalize(loop, os.close, fd)
        try:
            loop.add_reader(fd, clock.fire_due)
        except BaseException:
            self._close_timer()
            raise
        return clock

    def close_timer(self) -> None:
        """Close the timerfd now (the loop closed; its selector no longer watches it)."""
        if self._close_timer is not None:
            self._close_timer()

    def checkpoint(self) -> _Yield:
        """A bare yield: one loop iteration, raising a pending cancellation."""
        return YIELD

    def admit(self) -> Awaitable[None]:
        """A checkpoint, or a wait for a later pass when this one admitted enough launches."""
        if self._admitted < ADMITTED_PER_PASS and not self._queued:
            self._admitted += 1
            self._schedule_next_pass()
            return YIELD
        return self._queue_for_a_later_pass()

    async def _queue_for_a_later_pass(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append(future)
        self._schedule_next_pass()
        await future  # cancelled: the pass skips it

    def _schedule_next_pass(self) -> None:
        if not self._next_pass_scheduled:
            loop = self.loop()
            if loop is not None:
                self._next_pass_scheduled = True
                loop.call_soon(self._next_pass)

    def _next_pass(self) -> None:
        """Runs once per pass while launches are admitted: lets the next ones through."""
        self._next_pass_scheduled = False
        self._admitted = 0
        queued = self._queued
        while queued and self._admitted < ADMITTED_PER_PASS:
            future = queued.popleft()
            if not future.done():
                future.set_result(None)
                self._admitted += 1
        if self._admitted:
            self._schedule_next_pass()

    def wait(self, register: Register) -> Coroutine[Any, Any, None]:
        """Await the callback ``register`` hands to a backend (see :meth:`Loop.wait`)."""
        return _wait(self._bridge, register)

    async def sleep_until(self, when: float) -> None:
        """Sleep on the loop's clock until ``when``."""
        future = asyncio.get_running_loop().create_future()
        alarm = self.clock.schedule(when, partial(self._bridge.deliver, future, None))
        try:
            await future
        finally:
            alarm.cancel()


async def _wait(bridge: _Bridge, register: Register) -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    registration = register(_Delivery(bridge, future))
    if future.done():  # fired inside register(), on this thread: still a checkpoint
        await YIELD
        future.result()
        return
    try:
        await future
    except asyncio.CancelledError:
        registration.cancel()
        raise


_states: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioLoop]] = (
    weakref.WeakKeyDictionary()
)


class _LastLoop(threading.local):
    """Each thread's most recent loop state: a lookup without hashing the loop."""

    state: AsyncioLoop | None = None


_last: Final = _LastLoop()


def current_asyncio_loop(loop: asyncio.AbstractEventLoop) -> AsyncioLoop:
    """The state of the running asyncio ``loop`` (created on first use)."""
    state = _last.state
    if state is not None and state.loop() is loop:
        return state
    state = _states.get(loop)
    if state is None:
        for other, old in list(_states.items()):
            if other.is_closed():  # a closed loop's timerfd: close it now, not at collection
                old.close_timer()
                del _states[other]
        state = _states[loop] = AsyncioLoop(loop)
    _last.state = state
    return state
