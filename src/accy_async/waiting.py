"""Awaiting device completion without blocking the event loop.

Backends report completion through callbacks that may run on any thread (a
CPU stream's worker, the CUDA backend's completion reactor). This module turns
such a callback into an ``await`` on asyncio (uvloop too) and trio:

* no thread and no polling task per wait: a wait is a future (asyncio) or a
  parked task (trio) plus one registered callback, so tens of thousands of
  concurrent waits cost memory, not threads;
* completions that arrive together wake their loop once: a per-loop bridge
  batches them into a single thread-safe call;
* cancelling a wait withdraws its callback, leaving nothing behind;
* a device fault reported to a waiter is raised in it as a fresh
  :class:`~accy_async.errors.DeviceFault` chained to the backend's.

The functions take the backend and the thing to wait for::

    backend.record_event(event, stream)
    await accy.wait_event(backend, event)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any, Final

import anyio
import anyio.lowlevel
import sniffio

from .alarms import alarm_clock
from .backends.base import (
    Anticipation,
    Backend,
    CompletionCallback,
    CompletionRegistration,
    DeviceObject,
    EventHandle,
    Latch,
    PendingRead,
    StreamHandle,
)
from .errors import AccyError

WAKE_CHUNK: Final = 64
"""Most waiters one wake-up resumes; a larger burst is spread over loop iterations."""

CLEANUP_WAIT_SECONDS: float = 30.0
"""How long clean-up waits for queued work before deferring the release instead."""

__all__ = [
    "CLEANUP_WAIT_SECONDS",
    "CompletionLatch",
    "release_when_idle",
    "synchronize",
    "wait_completion",
    "wait_event",
    "wait_read",
    "wait_stream",
]

Register = Callable[[CompletionCallback], CompletionRegistration]


async def wait_event(backend: Backend, event: EventHandle) -> None:
    """Return once ``event``'s latest record has completed.

    Raises the backend's :class:`~accy_async.errors.DeviceFault` if the device
    faults first. Returns at once, without suspending, if it already completed.
    """
    if backend.query_event(event):
        return
    expected = backend.anticipate(event)
    if expected is None or not await _anticipated_wait(
        partial(backend.query_event, event), expected
    ):
        await wait_completion(partial(backend.notify_when_complete, event))


MAX_ANTICIPATED_WAITS: Final = 16
"""Most waits of one event loop that watch their events themselves; the rest are called back.

Each such wait polls from the loop around its due time, so a crowd of them
(thousands of tasks behind one kernel) would keep the loop spinning.
"""


class _Anticipating(threading.local):
    count = 0


_anticipating: Final = _Anticipating()


_EARLY_CHECKS: Final = 4
"""How many times a sleeping anticipated wait looks in, in case the work ends early."""

_CHECK_BOUNDS: Final = (50e-6, 10e-3)
"""The shortest and longest time between those looks, in seconds."""

_APPROACH: Final = 300e-6
"""The length of the last sleep before the watch: short sleeps land on time, long ones late."""


async def _anticipated_wait(query: Callable[[], bool], expected: Anticipation) -> bool:
    """Watch for a completion (``query``) from this loop's thread around its due time.

    Waking a sleeping event loop from another thread costs tens to hundreds of
    microseconds on some machines (virtual ones above all); a loop that wakes
    itself (:mod:`accy_async.alarms`) and then polls sees the completion
    within microseconds. So the wait sleeps until the alarm clock's margin
    before ``expected.due`` (looking in a few times on the way, in case the
    work ends early, and arriving through one short sleep, which lands on time
    more reliably than a long one), then polls the event, yielding to other
    tasks between polls, until ``expected.patience`` past the due time.
    Returns whether the event completed; if not (or at once, when
    :data:`MAX_ANTICIPATED_WAITS` waits of this loop already watch), the
    caller falls back to the backend's callback. Nothing is registered with
    the backend meanwhile, so no other thread runs.
    """
    if _anticipating.count >= MAX_ANTICIPATED_WAITS:
        return False
    _anticipating.count += 1
    try:
        clock = alarm_clock()
        wake_at = expected.due - clock.margin
        low, high = _CHECK_BOUNDS
        look_every = min(max(expected.duration / _EARLY_CHECKS, low), high)
        now = time.perf_counter()
        if now >= wake_at:
            clock.missed_a_sleep()
        while now < wake_at:
            if wake_at - now <= _APPROACH:
                await clock.sleep_until(wake_at)
                now = time.perf_counter()
                clock.observe_lateness(now - wake_at)
            else:
                await clock.sleep_until(min(now + look_every, wake_at - _APPROACH))
                now = time.perf_counter()
            if query():
                return True
        give_up_at = expected.due + expected.patience
        yield_to_others = _checkpoint()
        while not query():
            if time.perf_counter() > give_up_at:
                return False
            await yield_to_others()
        return True
    finally:
        _anticipating.count -= 1


def _checkpoint() -> Callable[[], Awaitable[None]]:
    """The cheapest cancellable yield of the running library (AnyIO's adds a lookup)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.checkpoint
    return partial(asyncio.sleep, 0)


async def wait_stream(backend: Backend, stream: StreamHandle | None = None) -> None:
    """Return once all work enqueued on ``stream`` (default: the default stream) has completed.

    Work enqueued after the call is not waited for. Where the backend offers a
    stream mark (CUDA), the wait is anticipated as :func:`wait_event`'s is.
    """
    mark = backend.mark_stream(stream)
    if mark is None:
        await wait_completion(partial(backend.notify_when_stream_complete, stream))
        return
    try:
        if not mark.query():
            expected = mark.anticipate()
            if expected is None or not await _anticipated_wait(mark.query, expected):
                await wait_completion(mark.notify_when_complete)
    finally:
        mark.release()


async def wait_read(pending: PendingRead) -> memoryview:
    """Await an enqueued device-to-host copy and return its bytes.

    If the wait is cancelled or fails, the read is discarded.
    """
    try:
        mark = pending.stream_mark()
        if mark is None:
            await wait_completion(pending.notify_when_complete)
        elif not mark.query():
            expected = mark.anticipate()
            if expected is None or not await _anticipated_wait(mark.query, expected):
                await wait_completion(pending.notify_when_complete)
    except BaseException:
        pending.discard()
        raise
    return pending.result()


async def synchronize(
    backend: Backend,
    *,
    stream: StreamHandle | None = None,
    event: EventHandle | None = None,
) -> None:
    """The seed's ``synchronize`` with its three scopes, without blocking the loop.

    With ``event``: that event; with ``stream``: that stream; with neither: every
    live stream of the device.
    """
    if event is not None:
        await wait_event(backend, event)
    elif stream is not None:
        await wait_stream(backend, stream)
    else:
        for each in backend.live_streams():
            await wait_stream(backend, each)


async def release_when_idle(
    backend: Backend,
    objects: Sequence[DeviceObject],
    streams: Sequence[StreamHandle | None],
    *,
    patience: float | None = None,
) -> None:
    """Destroy ``objects`` once the work queued on ``streams`` has finished.

    The clean-up path of every owner (loaded kernels, pools, pipelines, graph
    runs): it waits shielded from cancellation for at most ``timeout``
    seconds, then destroys each object exactly once. If the wait fails or
    times out, the objects go to the backend's deferred releases instead: a
    leak until the device is done with them, never a dangling use. After a
    device fault nothing will run again, so they are destroyed at once.
    """
    if not objects:
        return
    streams = list(streams) or [None]
    finished = backend.fault is not None or backend.closed
    if not finished:
        try:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(CLEANUP_WAIT_SECONDS if patience is None else patience),
            ):
                try:
                    for stream in streams:
                        await wait_stream(backend, stream)
                    finished = True
                except AccyError:
                    finished = backend.fault is not None or backend.closed
        except BaseException:
            # asyncio's own Task.cancel() goes through AnyIO's shield: hand the objects to
            # the deferred releases (nothing is awaited there) and let the cancellation go on.
            _defer(backend, objects, streams)
            raise
    if finished:
        backend.destroy_all(objects)
        return
    _defer(backend, objects, streams)


def _defer(
    backend: Backend, objects: Sequence[DeviceObject], streams: Sequence[StreamHandle | None]
) -> None:
    """Release ``objects`` once ``streams`` are idle (at once if the backend cannot wait)."""
    try:
        backend.defer_destroy(objects, after=streams)
    except AccyError:
        backend.destroy_all(objects)


class CompletionLatch(Latch):
    """A :class:`~accy_async.backends.base.Latch` that tasks can await.

    Hand the latch itself to a backend as the callback (it is callable), then
    ``await latch.wait()`` from as many tasks as you like.
    """

    __slots__ = ()

    async def wait(self) -> None:
        """Return once the latch fired; raise the error it fired with, if any."""
        if self.done:
            if self.error is not None:
                raise _fresh(self.error)
            return
        await wait_completion(self.register)


def wait_completion(register: Register) -> Coroutine[Any, Any, None]:
    """The wait for the callback that ``register`` hands to a backend; await it.

    ``register`` receives the callback and returns its registration; the
    callback may fire on any thread, or at once inside ``register``. (A plain
    function returning the library's own coroutine: one coroutine fewer per
    wait, which a thousand concurrent waits feel in the garbage collector.)
    """
    if sniffio.current_async_library() == "trio":
        return _trio_wait(register)
    return _asyncio_wait(register)


def _fresh(error: BaseException) -> BaseException:
    """A new exception for one waiter, so concurrent raisers don't share a traceback."""
    if isinstance(error, AccyError):
        copy = type(error).__new__(type(error))
        AccyError.__init__(copy, error.message, path=error.path)
        copy.__cause__ = error
        return copy
    return error


# ----- asyncio ----------------------------------------------------------------------------


class _AsyncioBridge:
    """Delivers completions to one asyncio loop, one thread-safe wake-up per batch."""

    __slots__ = ("__weakref__", "_batch", "_lock", "_loop", "_scheduled", "_thread_id")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
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
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._batch = self._batch[:WAKE_CHUNK], self._batch[WAKE_CHUNK:]
            more = bool(self._batch)
            self._scheduled = more
        for future, error in batch:
            _resolve(future, error)
        if more:  # let timers and other tasks run between chunks of a large burst
            self._loop.call_soon(self._drain)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(_fresh(error))


_asyncio_bridges: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncioBridge]] = (
    weakref.WeakKeyDictionary()
)


class _AsyncioDelivery:
    """The callback of one asyncio wait (one object, where a closure would take five)."""

    __slots__ = ("_bridge", "_future")

    def __init__(self, bridge: _AsyncioBridge, future: asyncio.Future[None]) -> None:
        self._bridge = bridge
        self._future = future

    def __call__(self, error: BaseException | None) -> None:
        self._bridge.deliver(self._future, error)


async def _asyncio_wait(register: Register) -> None:
    loop = asyncio.get_running_loop()
    bridge = _asyncio_bridges.get(loop)
    if bridge is None:
        bridge = _asyncio_bridges[loop] = _AsyncioBridge(loop)
    future: asyncio.Future[None] = loop.create_future()
    registration = register(_AsyncioDelivery(bridge, future))
    try:
        await future
    except asyncio.CancelledError:
        registration.cancel()
        raise


# ----- trio -------------------------------------------------------------------------------


class _TrioWaiter:
    """One parked trio task; calling it delivers its completion through the run's bridge."""

    __slots__ = ("bridge", "outcome", "suspended", "task")

    def __init__(self, bridge: _TrioBridge, task: Any) -> None:
        self.bridge = bridge
        self.task = task
        self.suspended = False
        self.outcome: Any = None

    def __call__(self, error: BaseException | None) -> None:
        self.bridge.deliver(self, error)


class _TrioBridge:
    """Delivers completions to one trio run, one ``run_sync_soon`` per batch."""

    __slots__ = ("_batch", "_lock", "_scheduled", "_thread_id", "_token")

    def __init__(self, token: Any) -> None:
        self._token = token
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._batch: list[tuple[_TrioWaiter, BaseException | None]] = []
        self._scheduled = False

    def deliver(self, waiter: _TrioWaiter, error: BaseException | None) -> None:
        if threading.get_ident() == self._thread_id:
            self._wake(waiter, error)
            return
        with self._lock:
            self._batch.append((waiter, error))
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(Exception):  # trio.RunFinishedError: nobody waits any more
            self._token.run_sync_soon(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._batch = self._batch[:WAKE_CHUNK], self._batch[WAKE_CHUNK:]
            more = bool(self._batch)
            self._scheduled = more
        for waiter, error in batch:
            self._wake(waiter, error)
        if more:  # let timers and other tasks run between chunks of a large burst
            self._token.run_sync_soon(self._drain)

    @staticmethod
    def _wake(waiter: _TrioWaiter, error: BaseException | None) -> None:
        import outcome
        import trio

        result = outcome.Value(None) if error is None else outcome.Error(_fresh(error))
        if waiter.suspended:
            waiter.suspended = False
            trio.lowlevel.reschedule(waiter.task, result)
        else:
            waiter.outcome = result


_trio_bridge_var: Any = None


async def _trio_wait(register: Register) -> None:
    import trio

    global _trio_bridge_var
    if _trio_bridge_var is None:
        _trio_bridge_var = trio.lowlevel.RunVar("accy_async_bridge")
    try:
        bridge: _TrioBridge = _trio_bridge_var.get()
    except LookupError:
        bridge = _TrioBridge(trio.lowlevel.current_trio_token())
        _trio_bridge_var.set(bridge)
    waiter = _TrioWaiter(bridge, trio.lowlevel.current_task())
    registration = register(waiter)
    if waiter.outcome is not None:  # completed inside register(), on this thread
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
