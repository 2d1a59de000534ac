"""Launch geometry: fixed, or derived per dimension from runtime scalars.

A *quantity* is a small expression of the runtime scalar arguments
(:class:`Fixed`, :class:`Forward`, :class:`CeilDiv`). Quantities size grid
dimensions, intermediates' extents, and stage scalars, so a plan states
``grid.x = ceil(n / 64)`` as data and nothing in it is code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final, TypeAlias

import msgspec

from ..errors import LaunchArgumentMismatch
from ._base import ArgumentIndex, Base, Tagged, plan_error
from .scalars import ScalarArgument, integer_value

__all__ = [
    "MAX_GRID_X",
    "MAX_GRID_YZ",
    "CeilDiv",
    "DerivedLaunch",
    "Dim3",
    "Fixed",
    "FixedLaunch",
    "Forward",
    "GridDimension",
    "KernelCallLaunch",
    "LaunchGeometry",
    "Quantity",
    "resolve_quantity",
]

MAX_GRID_X: Final = 2**31 - 1
"""The most blocks a grid has along x (CUDA's bound)."""
MAX_GRID_YZ: Final = 65535
"""The most blocks a grid has along y or z."""
_MAX_BLOCK_THREADS: Final = 1024
_MAX_SHARED_MEMORY_BYTES: Final = 227 * 1024

GridX = Annotated[int, msgspec.Meta(ge=1, le=MAX_GRID_X)]
GridYZ = Annotated[int, msgspec.Meta(ge=1, le=MAX_GRID_YZ)]
BlockXY = Annotated[int, msgspec.Meta(ge=1, le=_MAX_BLOCK_THREADS)]
BlockZ = Annotated[int, msgspec.Meta(ge=1, le=64)]
SharedMemoryBytes = Annotated[int, msgspec.Meta(ge=0, le=_MAX_SHARED_MEMORY_BYTES)]
Dim3: TypeAlias = tuple[int, int, int]


class LaunchGeometry(Base, frozen=True):
    """A grid of blocks (threadgroups) of threads, and dynamic shared memory bytes.

    Bounds are CUDA's: grid x up to 2**31-1, y and z up to 65535; a block of at
    most 1024 threads (z at most 64).
    """

    grid: tuple[GridX, GridYZ, GridYZ] = (1, 1, 1)
    block: tuple[BlockXY, BlockXY, BlockZ] = (1, 1, 1)
    shared_memory_bytes: SharedMemoryBytes = 0

    def __post_init__(self) -> None:
        _check_block(self.block, "block")


def _check_block(block: Sequence[int], *fields: str | int) -> None:
    """Refuse a block of more than 1024 threads."""
    threads = block[0] * block[1] * block[2]
    if threads > _MAX_BLOCK_THREADS:
        raise plan_error(
            f"block of {threads} threads exceeds the limit of {_MAX_BLOCK_THREADS}", *fields
        )


class Fixed(Tagged, tag="fixed", kw_only=False, frozen=True):
    """A constant quantity."""

    value: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class Forward(Tagged, tag="forward", frozen=True):
    """The value of runtime scalar argument ``argument_index`` (an integer)."""

    argument_index: ArgumentIndex


class CeilDiv(Tagged, tag="ceil_div", frozen=True):
    """``ceil(argument / divisor)`` of runtime scalar ``argument_index`` (an integer)."""

    argument_index: ArgumentIndex
    divisor: Annotated[int, msgspec.Meta(ge=1, le=2**32)]


Quantity: TypeAlias = Fixed | Forward | CeilDiv
GridDimension: TypeAlias = Quantity


def resolve_quantity(quantity: Quantity, arguments: Sequence[ScalarArgument]) -> int:
    """Evaluate ``quantity`` against the runtime scalar ``arguments``.

    Raises :class:`LaunchArgumentMismatch` when the argument it names is missing,
    a float, or negative.
    """
    if type(quantity) is Fixed:
        return quantity.value
    index = quantity.argument_index  # type: ignore[union-attr]
    if index >= len(arguments):
        raise LaunchArgumentMismatch(
            f"runtime scalar argument {index} is needed but only {len(arguments)} were given"
        )
    value = integer_value(arguments[index])
    if value is None or value < 0:
        raise LaunchArgumentMismatch(
            f"runtime scalar argument {index} must be a non-negative integer, "
            f"got {arguments[index]!r}"
        )
    if type(quantity) is CeilDiv:
        return -(-value // quantity.divisor)
    return value


class DerivedLaunch(Tagged, tag="derived", frozen=True):
    """A geometry whose grid dimensions are quantities of the stage's scalars."""

    grid: tuple[GridDimension, GridDimension, GridDimension]
    block: tuple[BlockXY, BlockXY, BlockZ]
    shared_memory_bytes: SharedMemoryBytes = 0

    def __post_init__(self) -> None:
        _check_block(self.block, "block")

    def resolve(self, scalars: Sequence[ScalarArgument]) -> tuple[Dim3, Dim3, int]:
        """The ``(grid, block, shared_memory_bytes)`` for these stage scalars.

        Raises :class:`LaunchArgumentMismatch` when a dimension resolves to zero
        or beyond CUDA's limits.
        """
        x, y, z = (resolve_quantity(dim, scalars) for dim in self.grid)
        if not (1 <= x <= MAX_GRID_X and 1 <= y <= MAX_GRID_YZ and 1 <= z <= MAX_GRID_YZ):
            raise LaunchArgumentMismatch(
                f"derived grid ({x}, {y}, {z}) is empty or beyond the device's limits"
            )
        return (x, y, z), self.block, self.shared_memory_bytes


class FixedLaunch(Tagged, tag="fixed", frozen=True):
    """A geometry that does not depend on runtime scalars."""

    geometry: LaunchGeometry

    def resolve(self, scalars: Sequence[ScalarArgument]) -> tuple[Dim3, Dim3, int]:
        """The fixed ``(grid, block, shared_memory_bytes)``."""
        del scalars
        geometry = self.geometry
        return geometry.grid, geometry.block, geometry.shared_memory_bytes


KernelCallLaunch: TypeAlias = DerivedLaunch | FixedLaunch
"""How a registry entry's launch geometry is found: derived from scalars, or fixed."""
