"""The built-in plans' builders: each stage in CUDA C and as a CPU function.

See :mod:`accy_async.library`, which re-exports them.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Final, Literal, TypeAlias

from ..plan import (
    ArtifactFormat,
    CeilDiv,
    CpuKernelPayload,
    DerivedLaunch,
    DType,
    Fixed,
    Forward,
    Intermediate,
    KernelCallPipeline,
    KernelCallRegistry,
    Operand,
    PipelineBuffer,
    PipelineDocument,
    PipelineIntermediate,
    PipelineStage,
    Quantity,
    RegistryEntry,
    Result,
    RuntimeScalarBound,
    ScalarDerivation,
    TextPayload,
)
from .cpu import REDUCE_ITEMS, SAXPY_ITEMS, SCAN_VECTORS

__all__ = ["SINGLE_PASS_DTYPES", "ScanMethod", "cuda_source", "prefix_sum", "reduce_sum", "saxpy"]

ScanMethod: TypeAlias = Literal["single_pass", "three_stage"]
"""How :func:`prefix_sum` scans: one pass with decoupled look-back, or the three-stage reference."""

SINGLE_PASS_DTYPES: Final = (DType.F32, DType.I32, DType.U32)
"""The element types the single-pass scan takes (4-byte ones: a tile's state is one word)."""

_C_TYPES: Final = {
    DType.F32: "float",
    DType.F64: "double",
    DType.I32: "int",
    DType.U32: "unsigned int",
    DType.I64: "long long",
    DType.U64: "unsigned long long",
}
_N_BOUND: Final = RuntimeScalarBound(argument_index=0, min=1, max=2**32 - 1)
_SINGLE_BLOCK: Final = 1024
_INIT_BLOCK: Final = 256


@cache
def cuda_source(name: str) -> str:
    """The CUDA C of ``name`` (``scan``, ``saxpy``, ``reduce``) with its header inlined."""
    folder = resources.files(__package__) / "cuda"
    header = (folder / "common.cuh").read_text()
    source = (folder / f"{name}.cu").read_text()
    return source.replace('#include "common.cuh"', header)


def _check(dtype: DType, block: int) -> None:
    if dtype not in _C_TYPES:
        raise ValueError(f"built-in kernels take {[d.value for d in _C_TYPES]}, not {dtype.value}")
    if block < 32 or block > 1024 or block & (block - 1):
        raise ValueError(f"block must be a power of two from 32 to 1024, got {block}")


def _check_items(items: int) -> None:
    if not 1 <= items <= 64:
        raise ValueError(f"items per thread must be from 1 to 64, got {items}")


def _entries(
    target: str,
    source: str,
    cpu_name: str,
    entry_name: str,
    argument_count: int,
    scalars: int,
    grid_x: Quantity,
    block: int,
    dtype: DType,
    defines: tuple[str, ...] = (),
) -> tuple[RegistryEntry, RegistryEntry]:
    """The CPU and CUDA C registry entries of one stage."""
    launch = DerivedLaunch(grid=(grid_x, Fixed(1), Fixed(1)), block=(block, 1, 1))
    common = {
        "target": target,
        "version": 1,
        "entry_name": entry_name,
        "argument_count": argument_count,
        "runtime_scalar_argument_count": scalars,
        "launch": launch,
        "required_dtypes": (dtype,),
    }
    return (
        RegistryEntry(
            format=ArtifactFormat.CPU,
            payload=CpuKernelPayload(cpu_name),
            compile_options=defines,
            **common,  # type: ignore[arg-type]
        ),
        RegistryEntry(
            format=ArtifactFormat.CUDA_SOURCE,
            payload=TextPayload(cuda_source(source)),
            compile_options=(f"-DACCY_T={_C_TYPES[dtype]}", *defines),
            **common,  # type: ignore[arg-type]
        ),
    )


def _vector(name: str, dtype: DType) -> PipelineBuffer:
    return PipelineBuffer(name=name, dtype=dtype, extent=Forward(argument_index=0))


def prefix_sum(
    dtype: DType = DType.F32,
    block: int = 256,
    *,
    method: ScanMethod | None = None,
    vectors: int = SCAN_VECTORS,
) -> PipelineDocument:
    """Inclusive prefix sum of ``n`` elements: ``y[i] = x[0] + ... + x[i]``.

    ``method`` picks the algorithm; by default ``single_pass`` for the 4-byte
    types of :data:`SINGLE_PASS_DTYPES` and ``three_stage`` for the rest:

    * ``single_pass`` reads the input once and writes the output once: a small
      stage zeroes one state word per tile, then each block of ``block``
      threads scans a tile of ``block * vectors * 4`` elements and adds the
      total of the tiles before it, found by decoupled look-back (Merrill and
      Garland 2016: each tile publishes its total at once, and its inclusive
      prefix once known, and a tile sums its predecessors' until it meets a
      prefix). Two launches, whatever ``n``.
    * ``three_stage`` is the portable reference (the seed's device scan): stage
      1 scans tiles of ``block`` elements and writes each tile's total; stage
      2 scans the totals in one block of 1024 threads that loops over them,
      so any ``n`` works; stage 3 adds to each tile the total of the tiles
      before it.

    Integer types wrap like C; floats round per tile, and the order of the
    additions differs between the methods (results agree within float
    rounding, not bit for bit).
    """
    _check(dtype, block)
    chosen = method or ("single_pass" if dtype in SINGLE_PASS_DTYPES else "three_stage")
    if chosen == "single_pass":
        return _single_pass_scan(dtype, block, vectors)
    if chosen != "three_stage":
        raise ValueError(f"method must be 'single_pass' or 'three_stage', got {method!r}")
    return _three_stage_scan(dtype, block)


def _one_operand_document(
    target: str,
    dtype: DType,
    registry: KernelCallRegistry,
    intermediates: tuple[PipelineIntermediate, ...],
    stages: tuple[PipelineStage, ...],
    description: str,
    result: PipelineBuffer,
) -> PipelineDocument:
    """A pipeline of one operand ``x`` of ``n`` elements (the u32 scalar ``n``) and one result."""
    pipeline = KernelCallPipeline(
        target=target,
        version=1,
        operand_count=1,
        result_count=1,
        runtime_scalar_argument_count=1,
        runtime_scalar_types=("u32",),
        runtime_scalar_bounds=(_N_BOUND,),
        intermediates=intermediates,
        stages=stages,
    )
    return PipelineDocument(
        pipeline=pipeline,
        registry=registry,
        description=description,
        operands=(_vector("x", dtype),),
        results=(result,),
        runtime_scalar_names=("n",),
    )


def _scan_registry(
    source: str,
    dtype: DType,
    suffix: str,
    stages: tuple[tuple[str, int, Quantity, int], ...],
    defines: tuple[str, ...] = (),
) -> KernelCallRegistry:
    """The entries of a scan's stages: (kernel, argument count, grid, threads) each."""
    return KernelCallRegistry(
        entries=tuple(
            entry
            for name, count, grid, threads in stages
            for entry in _entries(
                f"accy.scan.{name}.{suffix}",
                source,
                f"accy.scan.{name}.{dtype.value}",
                name,
                count,
                1,
                grid,
                threads,
                dtype,
                defines,
            )
        )
    )


def _single_pass_scan(dtype: DType, block: int, vectors: int) -> PipelineDocument:
    if dtype not in SINGLE_PASS_DTYPES:
        raise ValueError(
            f"the single-pass scan takes {[d.value for d in SINGLE_PASS_DTYPES]}, not "
            f"{dtype.value}: use method='three_stage'"
        )
    if not 1 <= vectors <= 16:
        raise ValueError(f"vectors must be from 1 to 16, got {vectors}")
    suffix = f"{dtype.value}.b{block}v{vectors}"
    tile = block * vectors * 4
    tiles = CeilDiv(argument_index=0, divisor=tile)
    defines = (f"-DACCY_SCAN_BLOCK={block}", f"-DACCY_VECTORS={vectors}")
    stages = (
        ("scan_init", 3, CeilDiv(argument_index=0, divisor=tile * _INIT_BLOCK), _INIT_BLOCK),
        ("scan_tiles", 5, tiles, block),
    )
    registry = _scan_registry("lookback_scan", dtype, suffix, stages, defines)
    n: tuple[ScalarDerivation, ...] = (Forward(argument_index=0),)
    return _one_operand_document(
        f"accy.scan.inclusive_sum.{suffix}",
        dtype,
        registry,
        intermediates=(
            PipelineIntermediate(dtype=DType.U64, extent=tiles),  # one state per tile
            PipelineIntermediate(dtype=DType.U32, extent=Fixed(1)),  # the next tile's index
        ),
        stages=(
            PipelineStage(
                target=f"accy.scan.scan_init.{suffix}",
                version=1,
                buffers=(Intermediate(0), Intermediate(1)),
                scalars=n,
            ),
            PipelineStage(
                target=f"accy.scan.scan_tiles.{suffix}",
                version=1,
                buffers=(Result(0), Operand(0), Intermediate(0), Intermediate(1)),
                scalars=n,
            ),
        ),
        description=(
            f"Inclusive prefix sum of n {dtype.value} elements in one pass "
            f"(decoupled look-back, tiles of {tile})."
        ),
        result=_vector("y", dtype),
    )


def _three_stage_scan(dtype: DType, block: int) -> PipelineDocument:
    suffix = f"{dtype.value}.b{block}"
    tiles = CeilDiv(argument_index=0, divisor=block)
    stages = (
        ("block_scan", 4, tiles, block),
        ("sums_scan", 3, Fixed(1), _SINGLE_BLOCK),
        ("add_base", 3, tiles, block),
    )
    registry = _scan_registry("scan", dtype, suffix, stages)
    stage_scalars: tuple[ScalarDerivation, ...] = (Forward(argument_index=0),)
    return _one_operand_document(
        f"accy.scan.inclusive_sum.{suffix}",
        dtype,
        registry,
        intermediates=(
            PipelineIntermediate(dtype=dtype, extent=tiles),
            PipelineIntermediate(dtype=dtype, extent=tiles),
        ),
        stages=(
            PipelineStage(
                target=f"accy.scan.block_scan.{suffix}",
                version=1,
                buffers=(Result(0), Operand(0), Intermediate(0)),
                scalars=stage_scalars,
            ),
            PipelineStage(
                target=f"accy.scan.sums_scan.{suffix}",
                version=1,
                buffers=(Intermediate(1), Intermediate(0)),
                scalars=(tiles,),
            ),
            PipelineStage(
                target=f"accy.scan.add_base.{suffix}",
                version=1,
                buffers=(Result(0), Intermediate(1)),
                scalars=stage_scalars,
            ),
        ),
        description=f"Inclusive prefix sum of n {dtype.value} elements, tiles of {block}.",
        result=_vector("y", dtype),
    )


def saxpy(dtype: DType = DType.F32, block: int = 256, items: int = SAXPY_ITEMS) -> PipelineDocument:
    """``out = a * x + y`` over ``n`` elements; runtime scalars ``n`` (u32) and ``a``.

    Each thread handles ``items`` elements (16-byte vectors where they fit).
    """
    _check(dtype, block)
    if dtype not in (DType.F32, DType.F64):
        raise ValueError("saxpy takes f32 or f64")
    _check_items(items)
    suffix = f"{dtype.value}.b{block}i{items}"
    registry = KernelCallRegistry(
        entries=_entries(
            f"accy.blas.saxpy.{suffix}",
            "saxpy",
            f"accy.blas.saxpy.{dtype.value}",
            "saxpy",
            5,
            2,
            CeilDiv(argument_index=0, divisor=block * items),
            block,
            dtype,
            (f"-DACCY_ITEMS={items}",),
        )
    )
    pipeline = KernelCallPipeline(
        target=f"accy.blas.saxpy_pipeline.{suffix}",
        version=1,
        operand_count=2,
        result_count=1,
        runtime_scalar_argument_count=2,
        runtime_scalar_types=("u32", "f32" if dtype is DType.F32 else "f64"),
        runtime_scalar_bounds=(_N_BOUND,),
        stages=(
            PipelineStage(
                target=f"accy.blas.saxpy.{suffix}",
                version=1,
                buffers=(Result(0), Operand(0), Operand(1)),
                scalars=(Forward(argument_index=0), Forward(argument_index=1)),
            ),
        ),
    )
    return PipelineDocument(
        pipeline=pipeline,
        registry=registry,
        description=f"out = a * x + y over n {dtype.value} elements.",
        operands=(_vector("x", dtype), _vector("y", dtype)),
        results=(_vector("out", dtype),),
        runtime_scalar_names=("n", "a"),
    )


def reduce_sum(
    dtype: DType = DType.F32, block: int = 256, items: int = REDUCE_ITEMS
) -> PipelineDocument:
    """The sum of ``n`` elements into a one-element result, in two stages.

    Stage 1 adds ``block * items`` elements per block (16-byte vector loads
    where they fit) and writes one total per block; stage 2 adds the totals
    in one block.
    """
    _check(dtype, block)
    _check_items(items)
    suffix = f"{dtype.value}.b{block}i{items}"
    chunks = CeilDiv(argument_index=0, divisor=block * items)
    defines = (f"-DACCY_ITEMS={items}",)
    registry = KernelCallRegistry(
        entries=(
            *_entries(
                f"accy.reduce.partial_sum.{suffix}",
                "reduce",
                f"accy.reduce.partial_sum.{dtype.value}",
                "partial_sum",
                3,
                1,
                chunks,
                block,
                dtype,
                defines,
            ),
            *_entries(
                f"accy.reduce.final_sum.{suffix}",
                "reduce",
                f"accy.reduce.final_sum.{dtype.value}",
                "final_sum",
                3,
                1,
                Fixed(1),
                _SINGLE_BLOCK,
                dtype,
                defines,
            ),
        )
    )
    return _one_operand_document(
        f"accy.reduce.sum.{suffix}",
        dtype,
        registry,
        intermediates=(PipelineIntermediate(dtype=dtype, extent=chunks),),
        stages=(
            PipelineStage(
                target=f"accy.reduce.partial_sum.{suffix}",
                version=1,
                buffers=(Intermediate(0), Operand(0)),
                scalars=(Forward(argument_index=0),),
            ),
            PipelineStage(
                target=f"accy.reduce.final_sum.{suffix}",
                version=1,
                buffers=(Result(0), Intermediate(0)),
                scalars=(chunks,),
            ),
        ),
        description=f"Sum of n {dtype.value} elements.",
        result=PipelineBuffer(name="sum", dtype=dtype, extent=Fixed(1)),
    )
