"""Awaiting device completion without blocking the event loop.

``wait_event``, ``wait_stream`` and ``wait_read`` (and everything built on
them: ``launch_pipeline``, ``download``, graph runs) wait the same way:

* **Every wait is a checkpoint.** Work that is already complete costs one
  yield to the loop, where a pending cancellation is raised, so a task
  looping over fast launches never starves its loop.
* **Where the backend's completion can be watched from the loop** (CUDA:
  ``cuEventQuery`` is cheap, never blocks and needs no other thread), the
  wait watches it itself. With a forecast of the work (the backend learns
  each kernel's cost from what was launched, :mod:`accy_async.backends.forecast`)
  it sleeps on the loop's own precise clock until just before the work is
  due, looking in on the way, then polls between checkpoints until done
  (``frugal``: until just after, then polls sparsely).
  Without one (a kernel never seen, or one running long past its forecast)
  it follows a schedule that adapts to the elapsed time: a brief spin, then
  polls spaced by a fraction of the time waited so far.
* **A crowd** (more than :data:`MAX_WATCHERS` waits on one loop) is called
  back by the backend's completion reactor instead, and so are waits on
  backends whose completions come from their own threads (the CPU backend):
  completions that arrive together wake their loop once.
* **Cancellation** returns at once: a watching wait just stops; a called-back
  wait withdraws its callback; nothing is left behind.

Each wait follows a :data:`~accy_async.backends.WaitPolicy`, the backend's
(``backend.wait_policy``, ``"balanced"`` by default) or the call's
``policy=``: ``"latency"`` watches from the first moment (it may spin a
core), ``"balanced"`` sleeps until the work is nearly due, ``"frugal"`` sleeps
until a forecast spread (at least the clock's margin) *past* the due time, so
work that ends on time costs one wake-up, and polls sparsely after; about one
wait in :data:`FRUGAL_LEARNS_EVERY`, drawn at random, wakes a spread before the
due time instead, so a forecast that runs long still learns that the work got
shorter. The least CPU; more latency.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import anyio

from . import _loops
from .backends import (
    Anticipation,
    Backend,
    CompletionCallback,
    CompletionRegistration,
    DeviceObject,
    EventHandle,
    PendingRead,
    StreamLike,
    StreamMark,
    WaitPolicy,
)
from .backends._completion import Completion
from .backends._device_info import check_wait_policy
from .errors import AccyError

CLEANUP_WAIT_SECONDS: float = 30.0
"""How long clean-up waits for queued work before deferring the release instead."""

MAX_WATCHERS: Final = 16
"""Most waits of one event loop that watch their work themselves; the rest are called back.

Each watches from the loop around its due time, so a crowd of them (thousands
of tasks behind one kernel) would keep the loop spinning.
"""

FRUGAL_LEARNS_EVERY: Final = 8
"""About one ``frugal`` wait in this many (drawn at random, so no cycle of waits always
misses it) wakes a forecast spread before the due time.

The others wake once, past it: a completion seen then tells the forecast only
that the work ended before, so a forecast that runs long would never learn
that the work got shorter.
"""

__all__ = [
    "CLEANUP_WAIT_SECONDS",
    "FRUGAL_LEARNS_EVERY",
    "MAX_WATCHERS",
    "CompletionLatch",
    "await_mark",
    "release_when_idle",
    "sleep_until",
    "synchronize",
    "wait_completion",
    "wait_event",
    "wait_read",
    "wait_stream",
]


async def wait_event(
    backend: Backend, event: EventHandle, *, policy: WaitPolicy | None = None
) -> None:
    """Return once ``event``'s latest record has completed.

    Raises the backend's :class:`~accy_async.errors.DeviceFault` if the device
    faults first. A checkpoint even when the record has completed already.
    """
    if policy is not None:
        check_wait_policy(policy)
    tracer = backend.tracer
    record = None if tracer is None else tracer.begin("wait", f"event {event.id}", -1)
    try:
        if backend.query_event(event):
            await _loops.checkpoint()
            return
        await _watch(backend, _Event(backend, event), policy)
    except BaseException as exc:
        if record is not None:  # cancelled, or the device failed
            record.failed(exc)
        raise
    finally:
        if record is not None:
            tracer.end(record)  # type: ignore[union-attr]


async def wait_stream(
    backend: Backend, stream: StreamLike | None = None, *, policy: WaitPolicy | None = None
) -> None:
    """Return once all work enqueued on ``stream`` (default: the default stream) has completed.

    Work enqueued after the call is not waited for. A checkpoint even when the
    stream is idle. ``stream`` may be another library's (a PyTorch, CuPy or
    cuda.core stream, see :meth:`~accy_async.backends.base.Backend.adopt_stream`).
    """
    if policy is not None:
        check_wait_policy(policy)
    tracer = backend.tracer
    record = None if tracer is None else tracer.begin("wait", "stream", -1)
    try:
        mark = backend.mark_stream(stream)
        if mark is None:
            await _loops.current().wait(_StreamCallback(backend, stream))
            return
        try:
            await await_mark(backend, mark, policy)
        finally:
            mark.release()
    except BaseException as exc:
        if record is not None:  # cancelled, or the device failed
            record.failed(exc)
        raise
    finally:
        if record is not None:
            tracer.end(record)  # type: ignore[union-attr]


async def wait_read(pending: PendingRead, *, policy: WaitPolicy | None = None) -> memoryview:
    """Await an enqueued device-to-host copy and return its bytes.

    If the wait is cancelled or fails, the read is discarded. A checkpoint
    even when the copy has landed already.
    """
    try:
        if policy is not None:
            check_wait_policy(policy)
        mark = pending.stream_mark()
        if mark is None:
            await _loops.current().wait(pending.notify_when_complete)
        else:
            await await_mark(mark.backend, mark, policy)
    except BaseException:
        pending.discard()
        raise
    return pending.result()


async def synchronize(
    backend: Backend,
    *,
    stream: StreamLike | None = None,
    event: EventHandle | None = None,
    policy: WaitPolicy | None = None,
) -> None:
    """The seed's ``synchronize`` with its three scopes, without blocking the loop.

    With ``event``: that event; with ``stream``: that stream; with neither: every
    live stream of the device.
    """
    if event is not None:
        await wait_event(backend, event, policy=policy)
    elif stream is not None:
        await wait_stream(backend, stream, policy=policy)
    else:
        for each in backend.live_streams():
            await wait_stream(backend, each, policy=policy)


def wait_completion(register: _loops.Register) -> Coroutine[Any, Any, None]:
    """The wait for the callback that ``register`` hands to a backend; await it.

    ``register`` receives the callback and returns its registration; the
    callback may fire on any thread, or at once inside ``register`` (the wait
    is a checkpoint either way). Cancelling the wait withdraws the callback.
    """
    return _loops.current().wait(register)


def sleep_until(when: float) -> Coroutine[Any, Any, None]:
    """Sleep until the :func:`time.perf_counter` instant ``when``, on the loop's precise clock.

    The clock the waits themselves sleep on: asyncio and trio round a timer
    below a millisecond up to their selector's millisecond; this one does not.
    For pacing finer than that (a poll's period, a benchmark's gap between
    trials). Await it on an asyncio (uvloop too) or trio loop; cancelling it
    withdraws the alarm.
    """
    return _loops.sleep_until(when)


class CompletionLatch(Completion):
    """A :class:`~accy_async.backends.Completion` that tasks can await.

    Hand the latch itself to a backend as the callback (it is callable), then
    ``await latch.wait()`` from as many tasks as you like.
    """

    __slots__ = ()

    async def wait(self) -> None:
        """Return once the latch fired; raise (a copy of) the error it fired with, if any."""
        if self.done:
            await _loops.checkpoint()
            if self.error is not None:
                raise _loops.fresh_error(self.error)
            return
        await _loops.current().wait(self.register)


# ----- clean-up ---------------------------------------------------------------------------


async def release_when_idle(
    backend: Backend,
    objects: Sequence[DeviceObject],
    streams: Sequence[StreamLike | None],
    *,
    patience: float | None = None,
) -> None:
    """Destroy ``objects`` once the work queued on ``streams`` has finished.

    The clean-up path of every owner (loaded kernels, pools, pipelines, graph
    runs). It waits up to ``patience`` seconds (:data:`CLEANUP_WAIT_SECONDS`
    by default), then destroys each object exactly once. If the caller is
    cancelled (before or during the wait; on asyncio a plain ``Task.cancel()``
    counts, as in ``asyncio.wait_for``), or the wait fails or times out,
    the objects go to the backend's deferred releases instead and the call
    returns at once: a cancelled caller gets control back without waiting for
    the device, and nothing is freed while the device may still use it.
    After a device fault nothing will run again, so they are destroyed at once.
    """
    streams = _still_live(backend, streams)
    if not objects or _gone(backend):
        backend.destroy_all(objects)
        await _loops.checkpoint()
        return
    if _loops.cancelled():  # the caller is being cancelled: don't wait
        _defer(backend, objects, streams)
        await _loops.checkpoint()  # raises a scope's cancellation (asyncio's was delivered)
        return
    finished = False
    try:
        with anyio.move_on_after(CLEANUP_WAIT_SECONDS if patience is None else patience):
            for stream in streams:
                await wait_stream(backend, stream)
            finished = True
    except AccyError:
        finished = _gone(backend)
    except BaseException:  # cancelled while waiting: the device may still be using them
        _defer(backend, objects, streams)
        raise
    if finished:
        backend.destroy_all(objects)
    else:
        _defer(backend, objects, streams)


def _still_live(backend: Backend, streams: Sequence[StreamLike | None]) -> list[StreamLike | None]:
    """``streams`` without those destroyed since (else ``[None]``: the default stream).

    A destroyed stream cannot be waited for, and one that could not be must not
    make the clean-up skip the others: their work may still use the objects.
    (Work still queued on a stream destroyed since is not waited for: destroy a
    stream only once its work is done, or wait for the device.)
    """
    live = [
        stream
        for stream in streams
        if not isinstance(stream, DeviceObject)
        or backend.owns(stream)
        or stream is backend.default_stream
    ]
    return live or [None]


def _gone(backend: Backend) -> bool:
    """Whether nothing will run on ``backend`` again (a device fault, or closed)."""
    return backend.fault is not None or backend.closed


def _defer(
    backend: Backend, objects: Sequence[DeviceObject], streams: Sequence[StreamLike | None]
) -> None:
    """Release ``objects`` once ``streams`` are idle (at once if the backend cannot wait)."""
    try:
        backend.defer_destroy(objects, after=streams)
    except AccyError:
        backend.destroy_all(objects)


# ----- the watch ----------------------------------------------------------------------------


class _Event:
    """An event as a watch target (one object per wait)."""

    __slots__ = ("backend", "event")

    def __init__(self, backend: Backend, event: EventHandle) -> None:
        self.backend = backend
        self.event = event

    def query(self) -> bool:
        return self.backend.query_event(self.event)

    def anticipate(self) -> Anticipation | None:
        return self.backend.anticipate(self.event)

    def notify_when_complete(self, callback: CompletionCallback) -> CompletionRegistration:
        return self.backend.notify_when_complete(self.event, callback)


class _StreamCallback:
    """Registers a callback for a stream's work so far (backends without stream marks)."""

    __slots__ = ("backend", "stream")

    def __init__(self, backend: Backend, stream: StreamLike | None) -> None:
        self.backend = backend
        self.stream = stream

    def __call__(self, callback: CompletionCallback) -> CompletionRegistration:
        return self.backend.notify_when_stream_complete(self.stream, callback)


_Target: TypeAlias = "_Event | StreamMark"


@dataclass(frozen=True, slots=True)
class _Schedule:
    """How a policy watches; times in seconds."""

    spin_throughout: bool
    """Poll between checkpoints from start to end (``latency``)."""
    spread_factor: float
    """Wake the clock's margin and this many forecast spreads before the due time
    (a negative factor: spreads after it)..."""
    approach: bool
    """... arriving through one short sleep, which lands on time more reliably."""
    look_ins: int
    """How often to look in on the way, in case the work ends early, when the forecast is
    unsure (its spread over 5% of the time to go); never when it is sure."""
    learn_every: int
    """On about one wait in this many, drawn at random, wake a spread before the due time
    all the same (0: never), so that a forecast that runs long is seen to and learns."""
    tight_window: bool
    """Around the due time, poll between checkpoints (else on the clock, ``alarm_step`` apart)."""
    alarm_step: float
    least_patience: float
    """Watch at least this long past the due time before adapting to a late finish."""
    spin: float
    """Without a forecast, poll between checkpoints for this long first."""
    ratio: float
    """Then poll on the clock every ``ratio`` of the time waited so far..."""
    least_interval: float
    """... but no more often than this ..."""
    most_interval: float
    """... and no less often than this."""


_SCHEDULES: Final[dict[str, _Schedule]] = {
    # Polls between checkpoints from the start: nothing below is read.
    "latency": _Schedule(
        spin_throughout=True,
        spread_factor=0.0,
        approach=False,
        look_ins=0,
        learn_every=0,
        tight_window=True,
        alarm_step=0.0,
        least_patience=0.0,
        spin=math.inf,
        ratio=0.0,
        least_interval=0.0,
        most_interval=0.0,
    ),
    "balanced": _Schedule(
        spin_throughout=False,
        spread_factor=1.0,
        approach=True,
        look_ins=2,
        learn_every=0,
        tight_window=True,
        alarm_step=0.0,
        least_patience=50e-6,
        spin=20e-6,
        ratio=1 / 5,
        least_interval=40e-6,
        most_interval=1e-3,
    ),
    # One wake-up past the due time when the forecast holds (about two a wait before: waking
    # a spread early, then polling); benchmarks/results/README.md has what it costs.
    "frugal": _Schedule(
        spin_throughout=False,
        spread_factor=-1.0,
        approach=False,
        look_ins=0,
        learn_every=FRUGAL_LEARNS_EVERY,
        tight_window=False,
        alarm_step=100e-6,
        least_patience=100e-6,
        spin=0.0,
        ratio=1 / 2,
        least_interval=150e-6,
        most_interval=5e-3,
    ),
}

_TRUSTED_SPREAD: Final = 0.25
"""A forecast whose spread exceeds this share of the time to its due time is not slept on."""

_SHORT_WAIT: Final = 150e-6
"""Work due within this, or already past its due time, is watched around its forecast all
the same if that is unsure by no more than this (the first kernel on a fresh stream starts
later than forecast): at most a few hundred microseconds of polling between checkpoints."""

_APPROACH: Final = 300e-6
"""The length of the last sleep before the due time: short sleeps land on time, long ones late."""

_LOOK_BOUNDS: Final = (100e-6, 10e-3)
"""The shortest and longest time between look-ins on the way to the due time."""

_learning_draws = random.Random()
"""Draws which waits of the policies that look early only now and then (``learn_every``) do."""


async def await_mark(backend: Backend, mark: StreamMark, policy: WaitPolicy | None = None) -> None:
    """Wait for a stream mark (:meth:`~accy_async.backends.Backend.mark_stream`).

    How :func:`wait_stream` waits, for callers that keep a mark to wait for
    later (a graph run's stream ends): a checkpoint if it has completed, else
    watched as ``policy`` (the backend's by default) says. The caller
    releases the mark, whatever happens.
    """
    if mark.query():
        await _loops.checkpoint()
    else:
        await _watch(backend, mark, policy)


async def _watch(backend: Backend, target: _Target, policy: WaitPolicy | None) -> None:
    """Wait for ``target``, not complete at the last query, as the policy says."""
    schedule = _SCHEDULES[policy or backend.wait_policy]
    loop = _loops.current()
    if not backend.polled_from_loop or loop.watchers >= MAX_WATCHERS:
        await loop.wait(target.notify_when_complete)
        return
    loop.watchers += 1
    try:
        await _watch_from_loop(loop, target, schedule)
    finally:
        loop.watchers -= 1


async def _watch_from_loop(loop: _loops.Loop, target: _Target, schedule: _Schedule) -> None:
    """Watch ``target`` from the loop's thread until it completes."""
    query = target.query
    checkpoint = loop.checkpoint
    start = time.perf_counter()
    if schedule.spin_throughout:
        while not query():
            await checkpoint()
        return
    expected = target.anticipate()
    if expected is not None:
        to_go = expected.due - start
        if expected.spread > _TRUSTED_SPREAD * to_go and not (
            to_go <= _SHORT_WAIT and expected.spread <= _SHORT_WAIT
        ):
            expected = None  # too unsure to sleep on: the work's length is not what was launched
    if expected is not None:
        if await _sleep_until_due(loop, query, expected, schedule):
            return
        watch_until = expected.due + max(2 * expected.spread, schedule.least_patience)
        step = max(expected.spread / 2, schedule.alarm_step)
        while time.perf_counter() < watch_until:
            if query():
                return
            if schedule.tight_window:
                await checkpoint()
            else:
                await loop.sleep_until(time.perf_counter() + step)
    # No forecast, or the work runs past it: polls spaced by a fraction of the time waited
    # (since the due time, if the wait began before it: a late finish is judged by how late
    # it is; a forecast already past when the wait began counts for nothing).
    origin = start if expected is None else max(start, expected.due)
    while not query():
        now = time.perf_counter()
        elapsed = now - origin
        if elapsed < schedule.spin:
            await checkpoint()
            continue
        interval = elapsed * schedule.ratio
        interval = min(max(interval, schedule.least_interval), schedule.most_interval)
        await loop.sleep_until(now + interval)


async def _sleep_until_due(
    loop: _loops.Loop, query: Any, expected: Anticipation, schedule: _Schedule
) -> bool:
    """Sleep until the due time, less the clock's margin and ``spread_factor`` spreads.

    ``frugal``'s factor is negative: it wakes a spread (at least the clock's
    margin) past the due time, but for about one wait in ``learn_every``, which
    wakes a spread before it. Looks in on the way if the forecast is unsure, in
    case the work ends early; ``balanced`` arrives through one short sleep,
    which lands on time more reliably than a long one. Returns whether a
    look-in saw the work complete.
    """
    clock = loop.clock
    factor = schedule.spread_factor
    if schedule.learn_every and _learning_draws.random() * schedule.learn_every < 1.0:
        factor = 1.0
    if factor >= 0:
        wake_at = expected.due - clock.margin - factor * expected.spread
    else:  # past the due time, by at least the clock's margin: work that ends on time has
        wake_at = expected.due + max(-factor * expected.spread, clock.margin)
    now = time.perf_counter()
    if now >= wake_at:
        if now < expected.due:  # the margin, not the forecast, missed
            clock.missed_a_sleep()
        return False
    look_ins = schedule.look_ins
    if expected.spread <= 0.05 * (wake_at - now):  # sure of itself: no look-ins
        look_ins = 0
    low, high = _LOOK_BOUNDS
    look_every = min(max((wake_at - now) / (look_ins + 1), low), high)
    approach = _APPROACH if schedule.approach else 0.0
    while now < wake_at:
        if wake_at - now <= approach:
            await loop.sleep_until(wake_at)
            now = time.perf_counter()
            clock.observe_lateness(now - wake_at)
        elif look_ins:
            await loop.sleep_until(min(now + look_every, wake_at - approach))
            now = time.perf_counter()
        else:
            await loop.sleep_until(wake_at - approach)
            now = time.perf_counter()
        if query():
            return True
    return False
