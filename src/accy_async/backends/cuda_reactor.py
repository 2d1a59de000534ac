"""The CUDA backend's completion reactor: one thread that turns finished events into callbacks.

Two ways of noticing completion, chosen when the backend opens:

``"hostfunc"`` (default)
    Each watched event gets, on a *watcher stream* paired with the stream it
    was recorded on, a device-side wait on the event followed by a host
    function that is plain C ``sem_post`` (launched through ``libcuda`` with
    ctypes, so the driver's callback thread never needs the GIL). The reactor
    thread sleeps in ``sem_timedwait`` (the GIL released), wakes when the
    driver posts, and queries only the oldest pending event of each stream:
    events of one stream complete in order. No CPU is spent while nothing
    completes, the source streams never stall behind a host function, and a
    timed wake-up every few milliseconds notices sticky faults, after which
    host functions no longer run.

``"poll"``
    The reactor thread queries the oldest pending event of each stream every
    ``poll_interval`` seconds (sleeping with the thread's timer slack cut to
    a nanosecond), for drivers where host functions are slow.

Either way completions are handed to :mod:`accy_async.waiting`, which wakes
the awaiting tasks with one thread-safe call per event loop.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias

from ..errors import AccyError, DeviceFault
from .base import ALREADY_FIRED, CompletionCallback, CompletionRegistration
from .cuda_driver import driver, libc, libcuda, translate

__all__ = ["CompletionReactor", "ReactorKind"]

ReactorKind: TypeAlias = Literal["hostfunc", "poll"]

_FAULT_CHECK_SECONDS: Final = 0.005
_PR_SET_TIMERSLACK: Final = 29


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Watch:
    """One recorded event and the callbacks waiting for it."""

    __slots__ = ("callbacks", "done", "event", "on_done")

    def __init__(self, event: Any, on_done: Callable[[], None] | None) -> None:
        self.event = event
        self.callbacks: list[CompletionCallback] = []
        self.done = False
        self.on_done = on_done


class _Registration(CompletionRegistration):
    __slots__ = ("_callback", "_reactor", "_watch")

    def __init__(self, reactor: CompletionReactor, watch: _Watch, callback: Any) -> None:
        self._reactor = reactor
        self._watch = watch
        self._callback = callback

    def cancel(self) -> bool:
        with self._reactor.lock:
            try:
                self._watch.callbacks.remove(self._callback)
            except ValueError:
                return False
            return True


class CompletionReactor:
    """Watches CUDA events for one backend and fires their callbacks when they complete.

    ``context`` is made current on the reactor thread; ``on_fault`` is called
    (from the reactor thread) with the :class:`DeviceFault` of a sticky error,
    after which every pending and later watch fails with it.
    """

    def __init__(
        self,
        context: Any,
        on_fault: Callable[[DeviceFault], None],
        *,
        kind: ReactorKind = "hostfunc",
        poll_interval: float = 10e-6,
    ) -> None:
        self.kind = kind
        self.lock = threading.Lock()
        self._context = context
        self._on_fault = on_fault
        self._poll_interval = poll_interval
        self._pending: dict[int, deque[_Watch]] = {}
        self._watchers: dict[int, Any] = {}
        self._fault: AccyError | None = None
        self._stopping = False
        self._work = threading.Condition(self.lock)
        self._libc = libc()
        self._semaphore = ctypes.create_string_buffer(64)
        if self._libc.sem_init(self._semaphore, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._sem_post = ctypes.cast(self._libc.sem_post, ctypes.c_void_p).value
        self._sem_address = ctypes.addressof(self._semaphore)
        self._libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
        self._libc.sem_trywait.argtypes = [ctypes.c_void_p]
        self._thread = threading.Thread(
            target=self._run, name="accy-cuda-completion-reactor", daemon=True
        )
        self._thread.start()

    # ----- called from the backend's thread ------------------------------------------------

    def watch(
        self,
        event: Any,
        stream: Any,
        callback: CompletionCallback,
        *,
        on_done: Callable[[], None] | None = None,
    ) -> CompletionRegistration:
        """Call ``callback`` once ``event``, just recorded on ``stream``, completes.

        ``on_done`` runs once the event has completed (or failed), whether or
        not the callback is still registered (the backend returns pooled
        marker events with it).
        """
        key = int(stream)
        watch = _Watch(event, on_done)
        watch.callbacks.append(callback)
        with self.lock:
            fault = self._fault
            if fault is None:
                queue = self._pending.get(key)
                if queue is None:
                    queue = self._pending[key] = deque()
                queue.append(watch)
                self._work.notify()
        if fault is not None:
            callback(fault)
            return ALREADY_FIRED
        if self.kind == "hostfunc":
            self._enqueue_host_function(key, stream, event)
        return _Registration(self, watch, callback)

    def forget_stream(self, stream: Any) -> None:
        """The source stream is being destroyed: destroy its watcher stream too.

        Work already queued on the watcher still runs (``cuStreamDestroy``
        releases a stream once its work is done).
        """
        watcher = self._watchers.pop(int(stream), None)
        if watcher is not None:
            driver().cuStreamDestroy(watcher)

    def fail_all(self, error: AccyError) -> None:
        """Fail every pending watch (and every later one) with ``error``."""
        with self.lock:
            if self._fault is None:
                self._fault = error
            pending = [watch for queue in self._pending.values() for watch in queue]
            self._pending.clear()
            self._work.notify()
        self._fire(pending, error)
        self._libc.sem_post(self._semaphore)

    def close(self) -> None:
        """Stop the reactor thread and destroy the watcher streams."""
        with self.lock:
            self._stopping = True
            self._work.notify()
        self._libc.sem_post(self._semaphore)
        self._thread.join(timeout=5)
        d = driver()
        for watcher in self._watchers.values():
            d.cuStreamDestroy(watcher)
        self._watchers.clear()
        self._libc.sem_destroy(self._semaphore)

    def _enqueue_host_function(self, key: int, stream: Any, event: Any) -> None:
        d = driver()
        watcher = self._watchers.get(key)
        if watcher is None:
            result, watcher = d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING)
            if int(result):
                raise translate(result, "creating a watcher stream")
            self._watchers[key] = watcher
        (result,) = d.cuStreamWaitEvent(watcher, event, 0)
        if int(result):
            raise translate(result, "watching an event")
        code = libcuda().cuLaunchHostFunc(int(watcher), self._sem_post, self._sem_address)
        if code:
            raise translate(d.CUresult(code), "launching the completion host function")

    # ----- the reactor thread --------------------------------------------------------------

    def _run(self) -> None:
        d = driver()
        d.cuCtxSetCurrent(self._context)
        if self.kind == "poll":
            # Short sleeps are only short with the timer slack (50 us by default) cut.
            self._libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
        while True:
            with self.lock:
                while not self._pending and not self._stopping:
                    self._work.wait()
                if self._stopping:
                    return
            if self.kind == "hostfunc":
                self._wait_for_post(_FAULT_CHECK_SECONDS)
            completed, fault = self._sweep(d)
            if completed:
                self._fire(completed, None)
            if fault is not None:
                self._on_fault(fault)
                self.fail_all(fault)
            elif not completed and self.kind == "poll":
                time.sleep(self._poll_interval)

    def _wait_for_post(self, seconds: float) -> None:
        deadline = time.time() + seconds
        timeout = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        self._libc.sem_timedwait(self._semaphore, ctypes.byref(timeout))
        while self._libc.sem_trywait(self._semaphore) == 0:  # coalesce further posts
            pass

    def _sweep(self, d: Any) -> tuple[list[_Watch], DeviceFault | None]:
        """Pop every completed watch at the head of each stream's queue."""
        completed: list[_Watch] = []
        not_ready = d.CUresult.CUDA_ERROR_NOT_READY
        with self.lock:
            queues = list(self._pending.items())
        for key, queue in queues:
            while queue:
                (result,) = d.cuEventQuery(queue[0].event)
                if result == not_ready:
                    break
                if int(result):
                    error = translate(result, "waiting for an event")
                    if isinstance(error, DeviceFault):
                        return completed, error
                    watch = queue.popleft()
                    self._fire([watch], error)
                    continue
                completed.append(queue.popleft())
            if not queue:
                with self.lock:
                    if not queue and self._pending.get(key) is queue:
                        del self._pending[key]
        return completed, None

    def _fire(self, watches: list[_Watch], error: AccyError | None) -> None:
        for watch in watches:
            with self.lock:
                if watch.done:
                    continue
                watch.done = True
                callbacks, watch.callbacks = watch.callbacks, []
            for callback in callbacks:
                callback(error)
            if watch.on_done is not None:
                watch.on_done()
