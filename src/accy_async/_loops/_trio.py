"""The trio side of the loop layer.

A parked task is rescheduled directly when its completion fires on the run's
thread, and through the run's :class:`_Bridge` (one ``run_sync_soon`` per
batch) when it fires elsewhere. The run's alarm clock is a timerfd that a
system task waits on with ``wait_readable``; it is closed when the run ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Coroutine
from typing import Any, Final

import outcome
import trio

from ._base import Bridge, Loop, Register, fresh_error
from ._clock import TimerfdClock

__all__ = ["TrioLoop", "current_trio_loop"]


class _Waiter:
    """One parked trio task; calling it delivers its completion through the run's bridge."""

    __slots__ = ("bridge", "outcome", "suspended", "task")

    def __init__(self, bridge: _Bridge, task: Any) -> None:
        self.bridge = bridge
        self.task = task
        self.suspended = False
        self.outcome: Any = None

    def __call__(self, error: BaseException | None) -> None:
        self.bridge.deliver(self, error)


class _Bridge(Bridge[_Waiter]):
    """Delivers completions to one trio run (see :class:`~._base.Bridge`)."""

    __slots__ = ("_token",)

    def __init__(self, token: Any) -> None:
        super().__init__()
        self._token = token

    def _wake(self, waiter: _Waiter, error: BaseException | None) -> None:
        _wake(waiter, error)

    def _post_threadsafe(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # nobody waits any more
            self._token.run_sync_soon(callback)

    def _post_soon(self, callback: Callable[[], None]) -> None:
        self._token.run_sync_soon(callback)


def _wake(waiter: _Waiter, error: BaseException | None) -> None:
    result = outcome.Value(None) if error is None else outcome.Error(fresh_error(error))
    if waiter.suspended:
        waiter.suspended = False
        trio.lowlevel.reschedule(waiter.task, result)
    else:
        waiter.outcome = result


class TrioLoop(Loop):
    """The library's state for one trio run."""

    __slots__ = ("_bridge", "_lot", "_token")

    def __init__(self) -> None:
        super().__init__()
        self._token = trio.lowlevel.current_trio_token()
        self._bridge = _Bridge(self._token)
        self._lot = trio.lowlevel.ParkingLot()

    def _timerfd_clock(self) -> TimerfdClock:
        """A timerfd served by a system task of the run (which closes it when the run ends)."""
        clock = TimerfdClock()
        trio.lowlevel.spawn_system_task(_serve, clock, name="accy_async.alarm_clock")
        return clock

    def checkpoint(self) -> Coroutine[Any, Any, None]:
        """``trio.lowlevel.checkpoint()``."""
        return trio.lowlevel.checkpoint()  # noqa: ASYNC105 - awaited by the caller

    def admit(self) -> Coroutine[Any, Any, None]:
        """A checkpoint that holds one of the run's admission tokens until the task resumes.

        With every token out the caller parks; a task that resumes hands its
        token to the first parked one, which runs in a later batch. No
        ``run_sync_soon`` (a write to trio's wake-up socket) on the way.
        """
        if self._tokens and not self._lot:
            self._tokens -= 1
            return self._admitted()
        return self._park_for_a_token()

    async def _admitted(self) -> None:
        try:
            await trio.lowlevel.checkpoint()
        finally:
            self._pass_token_on()

    async def _park_for_a_token(self) -> None:
        await self._lot.park()  # cancelled while parked: it never got a token
        self._pass_token_on()

    def _pass_token_on(self) -> None:
        if not self._lot.unpark(count=1):
            self._tokens += 1

    def wait(self, register: Register) -> Coroutine[Any, Any, None]:
        """Await the callback ``register`` hands to a backend (see :meth:`Loop.wait`)."""
        return _wait(self._bridge, register)


async def _serve(clock: TimerfdClock) -> None:
    try:
        while True:
            await trio.lowlevel.wait_readable(clock.timer.fd)
            clock.fire_due()
    finally:
        os.close(clock.timer.fd)


async def _wait(bridge: _Bridge, register: Register) -> None:
    waiter = _Waiter(bridge, trio.lowlevel.current_task())
    registration = register(waiter)
    if waiter.outcome is not None:  # completed inside register(), on this thread
        await trio.lowlevel.checkpoint()
        waiter.outcome.unwrap()
        return
    waiter.suspended = True

    def abort(raise_cancel: Any) -> Any:
        del raise_cancel
        if registration.cancel():
            waiter.suspended = False
            return trio.lowlevel.Abort.SUCCEEDED
        return trio.lowlevel.Abort.FAILED

    await trio.lowlevel.wait_task_rescheduled(abort)


_state_var: Final = trio.lowlevel.RunVar[TrioLoop]("accy_async_loop")


def current_trio_loop() -> TrioLoop:
    """The state of the running trio run (created on first use)."""
    try:
        return _state_var.get()
    except LookupError:
        state = TrioLoop()
        _state_var.set(state)
        return state
