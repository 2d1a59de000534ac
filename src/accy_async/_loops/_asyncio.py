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
import types
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from functools import partial
from typing import Any, Final

from ._base import Bridge, Loop, Register, fresh_error
from ._clock import TimerfdClock

__all__ = ["YIELD", "AsyncioLoop", "current_asyncio_loop"]


class _Yield:
    """``await YIELD`` gives the loop one iteration (asyncio runs a bare ``yield`` so)."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield


YIELD: Final = _Yield()


class _Bridge(Bridge["asyncio.Future[None]"]):
    """Delivers completions to one asyncio loop (see :class:`~._base.Bridge`)."""

    __slots__ = ("_loop",)

    def __init__(self, loop: weakref.ref[asyncio.AbstractEventLoop]) -> None:
        super().__init__()
        self._loop = loop  # a weak reference: the loop's state must not keep the loop alive

    def _wake(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        _resolve(future, error)

    def _post_threadsafe(self, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(callback)

    def _post_soon(self, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is not None:
            loop.call_soon(callback)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(fresh_error(error))


class AsyncioLoop(Loop):
    """The library's state for one asyncio loop; holds no reference to the loop itself."""

    __slots__ = ("_bridge", "_close_timer", "_queued", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = weakref.ref(loop)
        self._bridge = _Bridge(self.loop)
        self._close_timer: Any = None
        self._queued: deque[asyncio.Future[None]] = deque()

    def _timerfd_clock(self) -> TimerfdClock:
        """A timerfd the loop's selector watches (``add_reader``), closed with the loop."""
        loop = self.loop()
        if loop is None:
            raise NotImplementedError("the loop is gone")
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
        """A checkpoint that holds one of the loop's admission tokens until the task resumes.

        With every token out (as many tasks yielded in admission and not yet
        resumed), the caller queues; a task that resumes hands its token to the
        first in the queue, which resumes a pass later. So at most
        :data:`ADMITTED_PER_PASS` admitted launches run per pass, and a lone
        task pays one yield and no scheduled callback.
        """
        if self._tokens and not self._queued:
            self._tokens -= 1
            return _admitted(self)
        return self._queue_for_a_token()

    async def _queue_for_a_token(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append(future)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():  # the token reached it: pass it on
                self.pass_token_on()
            raise
        self.pass_token_on()

    def pass_token_on(self) -> None:
        """An admitted task resumed: its token goes to the first queued launch, or back."""
        queued = self._queued
        while queued:
            future = queued.popleft()
            if not future.done():
                with contextlib.suppress(RuntimeError):  # the loop closed under it
                    future.set_result(None)
                    return
        self._tokens += 1

    def wait(self, register: Register) -> Coroutine[Any, Any, None]:
        """Await the callback ``register`` hands to a backend (see :meth:`Loop.wait`)."""
        return _wait(self._bridge, register)


@types.coroutine
def _admitted(state: AsyncioLoop) -> Generator[None, None, None]:
    """The admitted launch's yield; resumed (or cancelled, or closed), it passes its token on."""
    try:
        yield
    finally:
        state.pass_token_on()


async def _wait(bridge: _Bridge, register: Register) -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    registration = register(partial(bridge.deliver, future))
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
