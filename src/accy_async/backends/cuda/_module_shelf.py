"""Modules of destroyed kernels, kept loaded for the next load of the same image.

``cuModuleLoadData`` waits for every kernel running on the device, and while it
waits the driver holds every other thread's launches, event records and
allocations (on the H200, about 47 ms behind a 50 ms kernel:
``benchmarks/results/driver-hold-probe.txt``; ``cuModuleUnload`` waits too, but
holds no other thread). A ``launch_pipeline`` without a pool loads and destroys
its kernels on every call, and so does any code that loads a kernel for a while:
with the module kept, its next load takes it back with no driver call at all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Final, NamedTuple

from ._launch import TableKernel
from ._table_ptx import declares_module_variables

__all__ = ["ModuleShelf", "ShelvedModule"]

_SHELF_CAPACITY: Final = 64
"""How many idle modules a context keeps; the least recently shelved go first."""
_VERDICTS_KEPT: Final = 1024
"""Images whose PTX was read for module variables (all forgotten at once past this)."""


class ShelvedModule(NamedTuple):
    """An idle module, its kernel's function, and its table variant (or why it has none)."""

    module: Any
    function: Any
    table: TableKernel | str | None


class ModuleShelf:
    """Idle modules by ``(kernel name, argument count, image digest)``, least recently first.

    Taken and shelved on the event loop's thread; locked all the same, as the
    backend may close from another thread.
    """

    def __init__(self, capacity: int = _SHELF_CAPACITY) -> None:
        self.capacity = capacity
        self.taken = 0
        """How many loads were served from the shelf (tests and probes read it)."""
        self._idle: OrderedDict[tuple[str, int, bytes], list[ShelvedModule]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        self._stateless: dict[bytes, bool] = {}
        """Per image digest, whether its PTX declares no variables (read once per image)."""

    def may_keep(self, digest: bytes, ptx: bytes) -> bool:
        """Whether the module of the image ``digest`` may be shelved and taken back.

        Only one whose PTX is known (``ptx``; a cubin alone says nothing) and
        declares no ``__device__``/``__constant__`` data: a module that has some
        keeps what its kernels wrote there. Read once per image (a 76 KB PTX
        takes about 0.4 ms), as every load of it asks.
        """
        if not ptx:
            return False
        verdict = self._stateless.get(digest)
        if verdict is None:
            verdict = not declares_module_variables(ptx.decode(errors="replace"))
            if len(self._stateless) >= _VERDICTS_KEPT:
                self._stateless.clear()
            self._stateless[digest] = verdict
        return verdict

    def take(self, key: tuple[str, int, bytes]) -> ShelvedModule | None:
        """An idle module of ``key``'s image, now the caller's; ``None`` if none is kept."""
        with self._lock:
            kept = self._idle.get(key)
            if not kept:
                return None
            shelved = kept.pop()
            if not kept:
                del self._idle[key]
            self._count -= 1
            self.taken += 1
            return shelved

    def keep(self, key: tuple[str, int, bytes], shelved: ShelvedModule) -> list[ShelvedModule]:
        """Keep ``shelved`` for the next load of ``key``; the modules it pushed out, to unload."""
        with self._lock:
            self._idle.setdefault(key, []).append(shelved)
            self._idle.move_to_end(key)
            self._count += 1
            evicted: list[ShelvedModule] = []
            while self._count > self.capacity:
                oldest_key, oldest = next(iter(self._idle.items()))
                evicted.append(oldest.pop(0))
                if not oldest:
                    del self._idle[oldest_key]
                self._count -= 1
            return evicted

    def drain(self) -> list[ShelvedModule]:
        """Every kept module, now the caller's to unload (the backend is closing)."""
        with self._lock:
            drained = [shelved for kept in self._idle.values() for shelved in kept]
            self._idle.clear()
            self._count = 0
            return drained

    def __len__(self) -> int:
        return self._count
