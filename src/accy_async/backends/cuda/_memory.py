"""Device and pinned host memory of the CUDA backend, and the thread that frees it.

Destroyed buffers' memory is kept for reuse (:class:`BlockCache`). Frees that
may synchronize the device (``cuMemFree``, ``cuModuleUnload``,
``cuMemFreeHost``) run on the :class:`Janitor`'s thread, after the device's
running work (:func:`quiet_device`); on the event loop's only as a last resort
(an allocation out of memory frees the kept blocks and tries again).
"""

from __future__ import annotations

import bisect
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Final

from .driver import driver, translate

__all__ = ["Allocation", "BlockCache", "Janitor", "Staging", "quiet_device"]

_STAGING_POOL_BYTES: Final = 256 * 1024 * 1024
_MIN_STAGING: Final = 4096
_SPARE: Final = 64 * 1024


def quiet_device() -> None:
    """Wait, holding nothing, for the work the device runs now (on a worker thread).

    A module load or a ``cuMemFree`` behind a running kernel waits for it, and
    the driver holds every other thread's launches, records and allocations
    meanwhile; this wait holds no other thread (``driver-hold-probe.txt``), so
    the loop's driver calls stay free, and the load or free then finds the
    device idle (unless new work came in between). The waiting thread spins
    (the context's default scheduling, with more cores than contexts), as the
    held call did. An error of earlier work is left to the calls that report it.
    """
    driver().cuCtxSynchronize()


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
        while (item := self._queue.get()) is not None:
            # A free behind a running kernel would wait for it holding the driver: one wait
            # first, then the whole batch queued by then.
            quiet_device()
            while item is not None:
                self._do(*item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if item is None:  # closed while the batch ran
                return

    def _do(self, what: str, work: Callable[[], Any]) -> None:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - recorded and reported at close
            self.failures.append(f"{what}: {exc}")
            return
        if isinstance(result, tuple) and result and int(result[0]):
            self.failures.append(f"{what}: {translate(result[0], what)}")


class BlockCache:
    """Device allocations kept for reuse once their buffers are destroyed.

    ``cuMemFree`` waits for the whole device, and while it waits the driver
    holds every other thread's launches, records and allocations: code that
    allocates per request would stall its event loop behind other tasks'
    kernels at each free (PyTorch keeps a caching allocator for the same
    reason). A destroyed buffer's block is kept here instead (the caller made
    sure the device no longer uses it), and an allocation takes the smallest
    kept block that fits with at most a quarter (or 64 KiB) to spare. At most
    ``limit`` bytes are kept: a block past that is freed on the janitor's thread.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        """Bytes kept now."""
        self.taken = 0
        """How many allocations were served from kept blocks (tests and probes read it)."""
        self._capacities: list[int] = []  # sorted, one entry per kept block
        self._blocks: dict[int, list[int]] = {}  # capacity -> base addresses
        self._lock = threading.Lock()

    def take(self, size: int, alignment: int) -> Allocation | None:
        """A kept block for ``size`` bytes at ``alignment``, now the caller's; else ``None``."""
        with self._lock:
            if not self._capacities:
                return None
            index = bisect.bisect_left(self._capacities, size)
            if index == len(self._capacities):
                return None
            capacity = self._capacities[index]
            if capacity > size + max(size >> 2, _SPARE):
                return None
            bases = self._blocks[capacity]
            base = bases[-1]
            address = base + (-base) % alignment
            if address + size > base + capacity:
                return None
            bases.pop()
            if not bases:
                del self._blocks[capacity]
            del self._capacities[index]
            self.held -= capacity
            self.taken += 1
            return Allocation(base, address, capacity)

    def keep(self, allocation: Allocation) -> bool:
        """Keep ``allocation`` for reuse; ``False`` when it does not fit (the caller frees it)."""
        capacity = allocation.capacity
        with self._lock:
            if self.held + capacity > self.limit:
                return False
            bisect.insort(self._capacities, capacity)
            self._blocks.setdefault(capacity, []).append(allocation.base)
            self.held += capacity
            return True

    def drain(self) -> list[int]:
        """Every kept block's base address, now the caller's to free."""
        with self._lock:
            bases = [base for kept in self._blocks.values() for base in kept]
            self._blocks.clear()
            self._capacities.clear()
            self.held = 0
            return bases


class Allocation:
    """A device allocation: ``base`` to free, ``address`` (aligned) to use, ``capacity`` bytes.

    ``shared``: other libraries may use it on streams of theirs, so it is freed
    when destroyed (``cuMemFree`` waits for them), never kept for reuse.
    """

    __slots__ = ("address", "base", "capacity", "shared")

    def __init__(self, base: int, address: int, capacity: int) -> None:
        self.base = base
        self.address = address
        self.capacity = capacity
        self.shared = False

    def __int__(self) -> int:
        return self.address

    def __repr__(self) -> str:
        return f"<device allocation 0x{self.address:x}>"
