"""What was worked out from objects, remembered by the objects' identity: one LRU helper.

Plans are frozen, so what a launch works out from one (its checked form, its
schedule) holds for as long as the same objects come back. Keyed by ``id()``,
an entry keeps its objects referenced, so no id can be reused by another object
while the entry lives, and a lookup checks the objects are the very ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

__all__ = ["IdentityCache"]

_V = TypeVar("_V")


class IdentityCache(Generic[_V]):
    """At most ``capacity`` values, keyed by a tuple of objects (by identity) and an extra key.

    The least recently used entry goes first. Not thread-safe: use it from one
    thread (the event loop's).
    """

    __slots__ = ("_capacity", "_entries")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[Any, ...], tuple[tuple[object, ...], _V]] = OrderedDict()

    def get(self, objects: tuple[object, ...], extra: Hashable = None) -> _V | None:
        """The value remembered for these very ``objects`` (and ``extra``), or ``None``."""
        key = (*map(id, objects), extra)
        entry = self._entries.get(key)
        if entry is None:
            return None
        kept, value = entry
        for old, new in zip(kept, objects, strict=True):
            if old is not new:
                return None
        self._entries.move_to_end(key)
        return value

    def put(self, objects: tuple[object, ...], value: _V, extra: Hashable = None) -> _V:
        """Remember ``value`` for ``objects`` (and ``extra``); returns it."""
        self._entries[(*map(id, objects), extra)] = (objects, value)
        if len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)
