"""The loop layer: how completions, alarms and checkpoints reach a task on each event loop.

Internal. Everything above it (:mod:`accy_async.waiting` and the launchers)
is written once against :class:`Loop`; the asyncio (uvloop too) and trio
specifics live in ``_asyncio`` and ``_trio``, the precise clocks in
``_clock``. :func:`current` finds the running loop's state without sniffio:
an asyncio loop is running on this thread, or a trio run is.
"""

from __future__ import annotations

import asyncio
import math
import sys
from asyncio import _get_running_loop
from collections.abc import Awaitable
from functools import cache
from types import ModuleType
from typing import Final, Literal

import anyio

from ._asyncio import YIELD, current_asyncio_loop
from ._base import ADMITTED_PER_PASS, Loop, Register, fresh_error

__all__ = [
    "ADMITTED_PER_PASS",
    "Loop",
    "Register",
    "admit",
    "cancelled",
    "checkpoint",
    "current",
    "fresh_error",
    "library",
    "sleep_until",
]


_NO_LOOP: Final = "accy-async's awaitables need a running asyncio or trio event loop"


def current() -> Loop:
    """The library's state for the event loop running on this thread (made on first use).

    Raises :class:`RuntimeError` outside an asyncio or trio event loop.
    """
    loop = _get_running_loop()
    if loop is not None:
        return current_asyncio_loop(loop)
    if not _in_trio_run():
        raise RuntimeError(_NO_LOOP)
    return _trio_side().current_trio_loop()  # type: ignore[no-any-return]


def library() -> Literal["asyncio", "trio"]:
    """Which event loop library runs on this thread (uvloop counts as asyncio)."""
    if _get_running_loop() is not None:
        return "asyncio"
    if _in_trio_run():
        return "trio"
    raise RuntimeError(_NO_LOOP)


def _in_trio_run() -> bool:
    trio = sys.modules.get("trio")  # not imported: no trio run can be going on
    return trio is not None and bool(trio.lowlevel.in_trio_run())


@cache
def _trio_side() -> ModuleType:
    """``._trio``, imported once (an import statement per call costs a microsecond)."""
    from . import _trio

    return _trio


def checkpoint() -> Awaitable[None]:
    """The cheapest checkpoint of the running loop: it yields and raises a pending cancellation.

    What every public async function of the library awaits at least once,
    so a task looping over work that is already done never starves its loop.
    """
    if _get_running_loop() is not None:
        return YIELD
    if not _in_trio_run():
        raise RuntimeError(_NO_LOOP)
    return sys.modules["trio"].lowlevel.checkpoint()  # type: ignore[no-any-return]


def cancelled() -> bool:
    """Whether the running task is being cancelled: call it while handling an exception.

    True inside a cancelled AnyIO or trio scope, and on asyncio also after a
    plain ``Task.cancel()`` (``asyncio.wait_for``, ``asyncio.timeout``) that
    has not been taken back (:meth:`asyncio.Task.cancelling`): clean-up that
    would wait for the device defers its releases instead.
    """
    if anyio.current_effective_deadline() == -math.inf:
        return True
    if _get_running_loop() is None:
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def admit() -> Awaitable[None]:
    """The checkpoint that starts a launch: see :meth:`Loop.admit`."""
    return current().admit()


async def sleep_until(when: float) -> None:
    """Sleep until the :func:`time.perf_counter` instant ``when``, on the loop's precise clock.

    asyncio and trio round sub-millisecond timers up to their selector's
    millisecond; this clock does not.
    """
    await current().sleep_until(when)
