"""Device and pinned host memory of the CUDA backend, and the thread that frees it.

Frees that may synchronize the device (``cuMemFree``, ``cuModuleUnload``,
``cuMemFreeHost``) run on the :class:`Janitor`'s thread, never on the event loop's.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Final

from .driver import driver, translate

__all__ = ["Allocation", "Janitor", "Staging"]

_STAGING_POOL_BYTES: Final = 256 * 1024 * 1024
_MIN_STAGING: Final = 4096


class Staging:
    """Pinned host memory, pooled by power-of-two size class."""

    def __init__(self, janitor: Janitor) -> None:
        self._janitor = janitor
        self._free: dict[int, list[int]] = {}
        self._pooled = 0
        self._lock = threading.Lock()

    def take(
        self, size: int, bound: Callable[[], contextlib.AbstractContextManager[None]]
    ) -> tuple[int, int]:
        """A pinned block of at least ``size`` bytes, ``(pointer, capacity)``.

        Pooled, or new (allocated within ``bound()``: the backend's context current).
        """
        capacity = max(_MIN_STAGING, 1 << (max(size, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(capacity)
            if free:
                self._pooled -= capacity
                return free.pop(), capacity
        d = driver()
        with bound():
            result, pointer = d.cuMemHostAlloc(capacity, 0)
        if int(result):
            raise translate(result, f"allocating {capacity} bytes of pinned memory")
        return int(pointer), capacity

    def give_back(self, pointer: int, capacity: int) -> None:
        with self._lock:
            if self._pooled + capacity <= _STAGING_POOL_BYTES:
                self._free.setdefault(capacity, []).append(pointer)
                self._pooled += capacity
                return
        self._janitor.submit("freeing pinned memory", lambda: driver().cuMemFreeHost(pointer))

    def release_all(self) -> None:
        with self._lock:
            pointers = [p for free in self._free.values() for p in free]
            self._free.clear()
            self._pooled = 0
        d = driver()
        for pointer in pointers:
            d.cuMemFreeHost(pointer)


class Janitor:
    """A thread for driver calls that may synchronize the device (frees, unloads).

    Failures are remembered, not raised: the backend reports them as a
    :class:`ResourceWarning` when it closes (a failed free is a leak).
    """

    def __init__(self, context: Any) -> None:
        self._context = context
        self._queue: queue.SimpleQueue[tuple[str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run, name="accy-cuda-janitor", daemon=True)
        self._thread.start()

    def submit(self, what: str, work: Callable[[], Any]) -> None:
        self._queue.put((what, work))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        driver().cuCtxSetCurrent(self._context)
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, work = item
            try:
                result = work()
            except Exception as exc:  # noqa: BLE001 - recorded and reported at close
                self.failures.append(f"{what}: {exc}")
                continue
            if isinstance(result, tuple) and result and int(result[0]):
                self.failures.append(f"{what}: {translate(result[0], what)}")


class Allocation:
    """A device allocation: ``base`` to free, ``address`` (aligned) to use."""

    __slots__ = ("address", "base")

    def __init__(self, base: int, address: int) -> None:
        self.base = base
        self.address = address

    def __int__(self) -> int:
        return self.address

    def __repr__(self) -> str:
        return f"<device allocation 0x{self.address:x}>"
