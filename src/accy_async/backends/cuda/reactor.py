"""The CUDA backend's completion reactor: a thread that turns finished events into callbacks.

Events of one stream complete in the order they were recorded, so the reactor
keeps, per stream, a queue of watched events, and every ``poll_interval``
seconds queries only the oldest of each (``cuEventQuery``, a microsecond),
firing every watch that has completed. The thread sleeps with its timer slack
cut to a nanosecond, so short sleeps are short; it sleeps on a condition
while nothing is watched, and yields the GIL between bursts of callbacks.

Measured on an H200 (``benchmarks/results/``), two other designs lost: a host
function per wait (``cuLaunchHostFunc``) was slower, and queueing one per wait
on a stalled stream blocks the caller once the driver's queue fills; blocking
in ``cuEventSynchronize`` spins a core unless events are created with
``CU_EVENT_BLOCKING_SYNC``, and recording thousands of those behind a long
kernel blocked the host for the kernel's duration. Low latency for kernels of
predictable length comes from :meth:`CudaBackend.anticipate` instead.
Completions go to :mod:`accy_async.waiting`, which wakes the awaiting tasks
with one thread-safe call per event loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from ...errors import AccyError, DeviceFault
from .._completion import Completion
from .driver import driver, libc, translate

__all__ = ["CompletionReactor"]

_BATCH: Final = 16
_PR_SET_TIMERSLACK: Final = 29


class CompletionReactor:
    """Watches CUDA events for one backend and fires their completions when they complete.

    ``context`` is made current on the reactor's thread; ``on_fault`` is
    called (from that thread) with the :class:`DeviceFault` of a sticky error,
    after which every pending and later watch fails with it.
    """

    def __init__(
        self,
        context: Any,
        on_fault: Callable[[DeviceFault], None],
        *,
        poll_interval: float = 50e-6,
    ) -> None:
        self.lock = threading.Lock()
        self._context = context
        self._on_fault = on_fault
        self._poll_interval = poll_interval
        self._pending: dict[int, deque[tuple[Any, Completion]]] = {}
        self._thread: threading.Thread | None = None
        self._fault: AccyError | None = None
        self._stopping = False
        self._work = threading.Condition(self.lock)

    # ----- called from the backend's thread ------------------------------------------------

    def watch(self, event: Any, stream: Any, completion: Completion) -> None:
        """Fire ``completion`` once ``event``, just recorded on ``stream``, completes.

        It fires with ``None``, or with the error that prevents the completion
        (the device's fault); callers register their callbacks on it.
        """
        key = int(stream)
        with self.lock:
            fault = self._fault
            if fault is None:
                queue = self._pending.get(key)
                if queue is None:
                    queue = self._pending[key] = deque()
                queue.append((event, completion))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="accy-cuda-reactor", daemon=True
                    )
                    self._thread.start()
                self._work.notify_all()
        if fault is not None:
            completion(fault)

    @property
    def watched(self) -> int:
        """How many watches wait for the reactor's thread to see them complete."""
        with self.lock:
            return sum(len(queue) for queue in self._pending.values())

    def fail_all(self, error: AccyError) -> None:
        """Fail every pending watch (and every later one) with ``error``."""
        with self.lock:
            if self._fault is None:
                self._fault = error
            pending = [completion for queue in self._pending.values() for _, completion in queue]
            for queue in self._pending.values():
                queue.clear()
            self._work.notify_all()
        self._fire(pending, error)

    def close(self) -> None:
        """Stop the reactor's thread (after the backend drained its work)."""
        with self.lock:
            self._stopping = True
            self._work.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    # ----- the reactor threads -------------------------------------------------------------

    def _run(self) -> None:
        """Query the oldest watch of every stream, sleeping briefly between sweeps."""
        d = driver()
        d.cuCtxSetCurrent(self._context)
        libc().prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
        not_ready = d.CUresult.CUDA_ERROR_NOT_READY
        query = d.cuEventQuery
        sleep = time.sleep
        interval = self._poll_interval
        while True:
            with self.lock:
                while not any(self._pending.values()) and not self._stopping:
                    self._work.wait()
                if self._stopping:
                    return
                queues = list(self._pending.values())
            completed: list[Completion] = []
            fired = 0
            fault: DeviceFault | None = None
            for queue_of_stream in queues:
                while queue_of_stream:
                    event, completion = queue_of_stream[0]
                    (result,) = query(event)
                    if result == not_ready:
                        break
                    queue_of_stream.popleft()
                    if int(result):
                        error = translate(result, "waiting for an event")
                        if isinstance(error, DeviceFault):
                            fault = error
                        completion(error)
                        continue
                    completed.append(completion)
                    if len(completed) == _BATCH:
                        # A burst: fire what is done so far and let the event loop take
                        # the GIL before querying on.
                        self._fire(completed, None)
                        fired += len(completed)
                        completed = []
                        sleep(0)
            if completed:
                self._fire(completed, None)
                fired += len(completed)
            if fault is not None:
                self._on_fault(fault)
                self.fail_all(fault)
            elif not fired:
                sleep(interval)

    @staticmethod
    def _fire(completions: list[Completion], error: AccyError | None) -> None:
        for count, completion in enumerate(completions, 1):
            if not count % _BATCH:
                time.sleep(0)  # hand the GIL to the event loop during long bursts (fail_all)
            completion(error)
