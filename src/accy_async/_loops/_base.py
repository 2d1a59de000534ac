"""What the library keeps per running event loop, whatever the loop's library."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, TypeAlias

from ..backends._completion import CompletionCallback, CompletionRegistration
from ..errors import AccyError
from ._clock import AlarmClock

__all__ = ["ADMITTED_PER_PASS", "Loop", "Register", "fresh_error"]

ADMITTED_PER_PASS: Final = 4
"""Launches let through per pass of the loop (see :meth:`Loop.admit`)."""

Register: TypeAlias = Callable[[CompletionCallback], CompletionRegistration]
"""Hands a callback to a backend and returns its registration (see :meth:`Loop.wait`)."""


class Loop(ABC):
    """The library's state for one running event loop (asyncio, uvloop or a trio run).

    Use it only from the loop's own thread.
    """

    __slots__ = ("watchers",)

    def __init__(self) -> None:
        self.watchers = 0
        """How many waits of this loop are watching their work themselves right now."""

    @property
    @abstractmethod
    def clock(self) -> AlarmClock:
        """The loop's alarm clock: precise wake-ups, on the loop's thread where possible."""

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
    @abstractmethod
    def free_admissions(self) -> int:
        """Admission tokens not held: :data:`ADMITTED_PER_PASS` when no launch is being admitted."""

    @abstractmethod
    def wait(self, register: Register) -> Coroutine[Any, Any, None]:
        """Await the callback that ``register`` hands to a backend.

        The callback may fire on any thread, or at once inside ``register``;
        either way the wait is a checkpoint. Cancelling it withdraws the
        callback. An error the callback carries is raised as a fresh copy
        (:func:`fresh_error`), chained to the original.
        """

    @abstractmethod
    async def sleep_until(self, when: float) -> None:
        """Sleep until the :func:`time.perf_counter` instant ``when`` on the loop's clock."""


def fresh_error(error: BaseException) -> BaseException:
    """A new exception for one waiter, so concurrent raisers don't share a traceback."""
    if isinstance(error, AccyError):
        copy = type(error).__new__(type(error))
        AccyError.__init__(copy, error.message, path=error.path)
        copy.__cause__ = error
        return copy
    return error
