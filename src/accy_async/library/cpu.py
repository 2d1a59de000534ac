"""The built-in kernels as CPU functions, one per element type, over NumPy.

Each follows its CUDA twin stage for stage and reads the launch geometry the
same way (a block scans ``block[0]`` elements), so a pipeline computes the
same result, up to floating-point rounding, on either backend.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from ..backends.cpu_kernels import CpuLaunchContext, cpu_kernel
from ..plan import DType

__all__ = ["REDUCE_ITEMS", "SAXPY_ITEMS", "SCAN_VECTORS", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES: Final = (DType.F32, DType.F64, DType.I32, DType.U32, DType.I64, DType.U64)
REDUCE_ITEMS: Final = 16
"""Elements each thread of ``partial_sum`` adds by default (``ACCY_ITEMS`` in the CUDA source)."""
SAXPY_ITEMS: Final = 4
"""Elements each thread of ``saxpy`` computes by default (``ACCY_ITEMS``)."""
SCAN_VECTORS: Final = 12
"""Rows of 4 elements each thread of the single-pass scan holds by default (``ACCY_VECTORS``)."""
_PREFIX_FLAG: Final = 2 << 32
"""A tile state's flag for a published inclusive prefix (``ACCY_TILE_PREFIX << 32``)."""

Array = np.ndarray[Any, Any]


def _tiles(values: Array, tile: int, fill: Any) -> Array:
    """``values`` as rows of ``tile``, the last row padded with ``fill``."""
    rows = -(-values.size // tile)
    if rows * tile == values.size:
        return values.reshape(rows, tile)
    padded = np.full(rows * tile, fill, dtype=values.dtype)
    padded[: values.size] = values
    return padded.reshape(rows, tile)


def _register(dtype: DType) -> None:
    t = np.dtype(dtype.numpy_name)
    zero = t.type(0)
    suffix = dtype.value

    @cpu_kernel(f"accy.scan.block_scan.{suffix}")
    def block_scan(ctx: CpuLaunchContext, out: Array, src: Array, sums: Array, n: int) -> None:
        tile = ctx.block[0]
        scanned = np.cumsum(_tiles(src.view(t)[:n], tile, zero), axis=1, dtype=t)
        out.view(t)[:n] = scanned.reshape(-1)[:n]
        sums.view(t)[: scanned.shape[0]] = scanned[:, -1]

    @cpu_kernel(f"accy.scan.sums_scan.{suffix}")
    def sums_scan(ctx: CpuLaunchContext, scanned: Array, sums: Array, m: int) -> None:
        np.cumsum(sums.view(t)[:m], dtype=t, out=scanned.view(t)[:m])

    @cpu_kernel(f"accy.scan.add_base.{suffix}")
    def add_base(ctx: CpuLaunchContext, out: Array, scanned: Array, n: int) -> None:
        tile = ctx.block[0]
        values = out.view(t)[:n]
        bases = scanned.view(t)
        full = n // tile
        if full > 1:
            values[: full * tile].reshape(full, tile)[1:] += bases[: full - 1, None]
        if full >= 1 and n % tile:
            values[full * tile :] += bases[full - 1]

    @cpu_kernel(f"accy.blas.saxpy.{suffix}")
    def saxpy(ctx: CpuLaunchContext, out: Array, x: Array, y: Array, n: int, a: Any) -> None:
        np.add(t.type(a) * x.view(t)[:n], y.view(t)[:n], out=out.view(t)[:n], dtype=t)

    @cpu_kernel(f"accy.reduce.partial_sum.{suffix}")
    def partial_sum(ctx: CpuLaunchContext, partials: Array, src: Array, n: int) -> None:
        rows = _tiles(src.view(t)[:n], ctx.block[0] * ctx.define("ACCY_ITEMS", REDUCE_ITEMS), zero)
        partials.view(t)[: rows.shape[0]] = rows.sum(axis=1, dtype=t)

    @cpu_kernel(f"accy.reduce.final_sum.{suffix}")
    def final_sum(ctx: CpuLaunchContext, out: Array, partials: Array, m: int) -> None:
        out.view(t)[0] = partials.view(t)[:m].sum(dtype=t)

    del block_scan, sums_scan, add_base, saxpy, partial_sum, final_sum


def _register_single_pass(dtype: DType) -> None:
    """The single-pass scan's stages, for a 4-byte type (a tile's state holds its bits)."""
    t = np.dtype(dtype.numpy_name)
    zero = t.type(0)
    suffix = dtype.value

    @cpu_kernel(f"accy.scan.scan_init.{suffix}")
    def scan_init(ctx: CpuLaunchContext, states: Array, counter: Array, n: int) -> None:
        tiles = -(-n // _scan_tile(ctx))
        states.view(np.uint64)[:tiles] = 0
        counter.view(np.uint32)[0] = 0

    @cpu_kernel(f"accy.scan.scan_tiles.{suffix}")
    def scan_tiles(
        ctx: CpuLaunchContext, out: Array, src: Array, states: Array, counter: Array, n: int
    ) -> None:
        # Tile by tile, as the device adds: each tile scanned, then the tiles before it added.
        tile = _scan_tile(ctx)
        scanned = np.cumsum(_tiles(src.view(t)[:n], tile, zero), axis=1, dtype=t)
        prefixes = np.cumsum(scanned[:, -1], dtype=t)
        scanned[1:] += prefixes[:-1, None]
        out.view(t)[:n] = scanned.reshape(-1)[:n]
        # What the device leaves behind: every tile's inclusive prefix published, all taken.
        bits = prefixes.view(np.uint32).astype(np.uint64)
        states.view(np.uint64)[: prefixes.size] = bits | np.uint64(_PREFIX_FLAG)
        counter.view(np.uint32)[0] = prefixes.size

    del scan_init, scan_tiles


def _scan_tile(ctx: CpuLaunchContext) -> int:
    """Elements of one single-pass scan tile: threads x rows x 4, as the CUDA source has it."""
    return ctx.define("ACCY_SCAN_BLOCK", 256) * ctx.define("ACCY_VECTORS", SCAN_VECTORS) * 4


for _dtype in SUPPORTED_DTYPES:
    _register(_dtype)
    if _dtype.size == 4:
        _register_single_pass(_dtype)
