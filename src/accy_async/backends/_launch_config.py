"""Where and how wide a kernel runs: grid, block and dynamic shared memory, checked once.

As in cuda.core's ``launch(stream, config, kernel, *args)``, the geometry is one
object resolved once per stage or node and reused for every launch of it; the
stream, the waits and the signal stay per launch.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final, SupportsIndex

from ..errors import LaunchArgumentMismatch

__all__ = ["LaunchConfig"]

_MAX_SHARED_MEMORY: Final = 1 << 20


def _dim3(name: str, value: Sequence[SupportsIndex]) -> tuple[int, int, int]:
    """``value`` as three positive ints (NumPy ints too; not bools, not floats)."""
    try:
        x, y, z = value
        if x.__class__ is not int or y.__class__ is not int or z.__class__ is not int:
            x, y, z = _index(x), _index(y), _index(z)
    except (TypeError, ValueError):
        raise LaunchArgumentMismatch(f"{name} must be three positive ints, got {value!r}") from None
    if x < 1 or y < 1 or z < 1:
        raise LaunchArgumentMismatch(f"{name} must be three positive ints, got {value!r}")
    return (x, y, z)


def _index(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)  # type: ignore[arg-type]


class LaunchConfig:
    """A kernel launch's grid, block and dynamic shared memory; immutable and hashable.

    ``grid`` and ``block`` are three positive ints each (any sequence of
    three, NumPy ints too), ``shared_memory_bytes`` the dynamic shared
    memory per block. Made once per stage or node and reused: making one
    checks it (about a microsecond).
    :class:`~accy_async.errors.LaunchArgumentMismatch` when a dimension is not
    a positive int or the shared memory is negative (the device checks its
    own limits when the kernel launches).
    """

    __slots__ = ("_hash", "block", "dims", "grid", "shared_memory_bytes")

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_memory_bytes: int
    dims: tuple[int, int, int, int, int, int, int]
    """``grid``, ``block`` and the shared memory in one tuple: ``cuLaunchKernel``'s order."""
    _hash: int

    def __init__(
        self,
        grid: Sequence[SupportsIndex],
        block: Sequence[SupportsIndex],
        shared_memory_bytes: int = 0,
    ) -> None:
        grid = _dim3("grid", grid)
        block = _dim3("block", block)
        if shared_memory_bytes.__class__ is not int or not (
            0 <= shared_memory_bytes <= _MAX_SHARED_MEMORY
        ):
            raise LaunchArgumentMismatch(
                f"shared_memory_bytes must be an int from 0 to {_MAX_SHARED_MEMORY}, "
                f"got {shared_memory_bytes!r}"
            )
        self._fill(grid, block, shared_memory_bytes)

    @classmethod
    def unchecked(
        cls, grid: tuple[int, int, int], block: tuple[int, int, int], shared_memory_bytes: int
    ) -> LaunchConfig:
        """A config of values the caller has checked already: no checks made again.

        Three positive ints each for ``grid`` and ``block``, the shared memory
        in range: what a plan's resolution makes for each new size.
        """
        config = object.__new__(cls)
        config._fill(grid, block, shared_memory_bytes)
        return config

    def _fill(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_memory_bytes: int
    ) -> None:
        setter = object.__setattr__
        setter(self, "grid", grid)
        setter(self, "block", block)
        setter(self, "shared_memory_bytes", shared_memory_bytes)
        dims = (*grid, *block, shared_memory_bytes)
        setter(self, "dims", dims)
        setter(self, "_hash", hash(dims))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"LaunchConfig is immutable (tried to set {name})")

    def __reduce__(self) -> tuple[type[LaunchConfig], tuple[object, ...]]:
        return (LaunchConfig, (self.grid, self.block, self.shared_memory_bytes))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LaunchConfig) and self.dims == other.dims

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (
            f"LaunchConfig(grid={self.grid}, block={self.block}, "
            f"shared_memory_bytes={self.shared_memory_bytes})"
        )
