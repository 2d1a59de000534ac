"""The objects a backend created and has not destroyed, and those whose release waits.

:class:`Registry` is the backend's book of live objects (every object is
destroyed exactly once: a second destroy finds it gone), of the bytes its
buffers hold, of the other libraries' streams it adopted, and of deferred
releases: objects to destroy once the device is done with them, handed in
from the loop's thread (:meth:`Registry.defer`) or from any thread
(:meth:`Registry.orphan`). The backend does the destroying; the registry
only keeps the books, so it is safe to use from the loop's thread while
completion callbacks and finalizers mark releases ready from others.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from ..errors import InvalidBuffer
from ._handles import BufferHandle, DeviceObject, StreamHandle, is_external

__all__ = ["Registry"]

_ORPHANS_TOKEN: Final = -1
"""In the ready queue of deferred releases: objects given up from another thread wait."""


class Registry:
    """The live objects of one backend, by id, and its deferred releases."""

    __slots__ = (
        "_deferred",
        "_ids",
        "_lock",
        "_orphans",
        "_tokens",
        "adopted",
        "backend_id",
        "live",
        "live_bytes",
        "ready",
        "removals",
    )

    def __init__(self, backend_id: int) -> None:
        self.backend_id = backend_id
        self.live: dict[int, DeviceObject] = {}
        """Every object created and not destroyed, by id (read it, change it through methods)."""
        self.live_bytes = 0
        """Bytes held by the live buffers, external ones included."""
        self.removals = 0
        """Objects forgotten so far: while it stays the same, every object live before still is."""
        self.adopted: dict[int, StreamHandle] = {}
        """Other libraries' streams in use, by raw handle."""
        self.ready: deque[int] = deque()
        """Tokens of deferred releases whose work has completed (appended from any thread)."""
        self._ids = itertools.count(1)
        self._deferred: list[tuple[int, list[DeviceObject]]] = []
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._orphans: deque[tuple[list[DeviceObject], StreamHandle | None]] = deque()

    # ----- live objects ----------------------------------------------------------------------

    def new_id(self) -> int:
        """The id of the next object the backend creates."""
        return next(self._ids)

    def add(self, obj: DeviceObject) -> None:
        """Count ``obj`` live (a buffer's bytes too)."""
        self.live[obj.id] = obj
        if isinstance(obj, BufferHandle):
            self.live_bytes += obj.byte_size

    def owns(self, obj: DeviceObject) -> bool:
        """Whether ``obj`` is one of the live objects."""
        return obj.backend_id == self.backend_id and self.live.get(obj.id) is obj

    def remove(self, obj: DeviceObject) -> None:
        """Forget ``obj``; :class:`InvalidBuffer` if it is not live (destroyed twice?)."""
        if not self.owns(obj):
            raise InvalidBuffer(f"{obj!r} is not a live object of this backend (destroyed twice?)")
        del self.live[obj.id]
        self.removals += 1
        if isinstance(obj, BufferHandle):
            self.live_bytes -= obj.byte_size

    def objects(self, *, owned_only: bool = False) -> Iterator[DeviceObject]:
        """The live objects, external buffers left out with ``owned_only``."""
        return (obj for obj in self.live.values() if not (owned_only and is_external(obj)))

    # ----- deferred releases -----------------------------------------------------------------

    def defer(
        self, objects: Sequence[DeviceObject], streams: int
    ) -> Callable[[BaseException | None], None]:
        """Hold ``objects`` until the returned callback has been called ``streams`` times.

        Register the callback for each stream's completion; once the last one
        calls it (from any thread), the objects are ready for :meth:`take_ready`.
        """
        token = next(self._tokens)
        lock, ready = self._lock, self.ready
        with lock:
            self._deferred.append((token, list(objects)))
        remaining = [streams]

        def on_complete(error: BaseException | None) -> None:
            del error
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            ready.append(token)

        return on_complete

    def orphan(self, objects: Sequence[DeviceObject], after: StreamHandle | None) -> None:
        """Objects given up from any thread, to defer after ``after`` on the loop's thread."""
        self._orphans.append((list(objects), after))
        self.ready.append(_ORPHANS_TOKEN)

    def take_ready(self) -> tuple[bool, set[int]]:
        """Empty the ready queue: whether orphans wait, and the ready releases' tokens."""
        tokens = set()
        while self.ready:
            tokens.add(self.ready.popleft())
        orphans = _ORPHANS_TOKEN in tokens
        tokens.discard(_ORPHANS_TOKEN)
        return orphans, tokens

    def take_orphans(self) -> deque[tuple[list[DeviceObject], StreamHandle | None]]:
        """The objects handed in from other threads so far, oldest first (each with its stream)."""
        taken: deque[tuple[list[DeviceObject], StreamHandle | None]] = deque()
        while self._orphans:
            taken.append(self._orphans.popleft())
        return taken

    def take_released(self, tokens: set[int] | None = None) -> list[list[DeviceObject]]:
        """The deferred releases with ``tokens`` (all of them with ``None``), forgotten here."""
        with self._lock:
            if tokens is None:
                taken, self._deferred = self._deferred, []
            else:
                taken = [entry for entry in self._deferred if entry[0] in tokens]
                self._deferred = [entry for entry in self._deferred if entry[0] not in tokens]
        return [objects for _, objects in taken]

    @property
    def deferred_count(self) -> int:
        """How many objects wait in deferred releases."""
        with self._lock:
            return sum(len(objects) for _, objects in self._deferred)
