"""Tuning problems for the built-in kernels: what ``accy-async tune`` runs by default.

Three kernels with their candidates, in the format the backend loads:

- ``saxpy``: block sizes x elements per thread (``-DACCY_ITEMS``);
- ``partial_sum`` (the first stage of the sum): block sizes x elements per thread;
- ``block_scan`` (the first stage of the three-stage prefix sum): block sizes,
  and on CUDA with and without ``--maxrregcount=32``;

and two whole pipelines: the three-stage prefix sum over its block sizes, and
the single-pass one (for its types) over threads x rows per thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec

from ..plan import (
    ArtifactFormat,
    ArtifactSpec,
    CeilDiv,
    DerivedLaunch,
    DType,
    Fixed,
    KernelTuningProblem,
    PipelineTuningProblem,
    RegistryEntry,
    TuningBuffer,
    TuningCandidate,
    TuningDocument,
    scalar,
)
from .builders import SINGLE_PASS_DTYPES, prefix_sum, reduce_sum, saxpy

__all__ = ["BUILTIN_TARGETS", "DEFAULT_TUNING_N", "problem_name", "tuning_document"]

DEFAULT_TUNING_N: Final = 1 << 24


def problem_name(kernel: str, dtype: DType) -> str:
    """The name of a built-in tuning problem: ``block_scan.f32``, ``prefix_sum.f32``..."""
    return f"{kernel}.{dtype.value}"


BUILTIN_TARGETS: Final = {
    "prefix_sum_f32": (
        problem_name("block_scan", DType.F32),
        problem_name("prefix_sum", DType.F32),
        problem_name("prefix_sum_single_pass", DType.F32),
    ),
    "saxpy_f32": (problem_name("saxpy", DType.F32),),
    "sum_f32": (problem_name("partial_sum", DType.F32),),
}
"""Built-in plan names ``accy-async tune`` takes, and the built-in tuning problems of each."""
_BLOCKS: Final = (128, 256, 512, 1024)
_SCAN_THREADS: Final = (128, 256, 512)
_SCAN_VECTORS: Final = (4, 8, 12, 16)


def _entry(document_registry: Iterable[RegistryEntry], entry_name: str) -> RegistryEntry:
    for entry in document_registry:
        if entry.entry_name == entry_name:
            return entry
    raise LookupError(entry_name)


def _without_items(spec: ArtifactSpec) -> ArtifactSpec:
    """``spec`` without its default ``-DACCY_ITEMS``: each candidate brings its own."""
    options = tuple(o for o in spec.compile_options if not o.startswith("-DACCY_ITEMS"))
    return msgspec.structs.replace(spec, compile_options=options)


def _candidates(
    blocks: Iterable[int], items: Iterable[int], options: Iterable[tuple[str, ...]] = ((),)
) -> tuple[TuningCandidate, ...]:
    chosen = []
    for option in options:
        for block in blocks:
            for each in items:
                grid = CeilDiv(argument_index=0, divisor=block * each)
                chosen.append(
                    TuningCandidate(
                        launch=DerivedLaunch(grid=(grid, Fixed(1), Fixed(1)), block=(block, 1, 1)),
                        compile_options=(f"-DACCY_ITEMS={each}", *option),
                        label=f"block {block}, {each} per thread"
                        + "".join(f" {o}" for o in option),
                    )
                )
    return tuple(chosen)


def tuning_document(
    format: ArtifactFormat, n: int = DEFAULT_TUNING_N, dtype: DType = DType.F32
) -> TuningDocument:
    """The built-in kernels' tuning problems for ``format`` over ``n`` elements of ``dtype``.

    ``dtype`` is ``f32`` or ``f64`` (saxpy's).
    """
    if format not in (ArtifactFormat.CPU, ArtifactFormat.CUDA_SOURCE):
        raise ValueError(f"the built-in kernels come as CPU functions and CUDA C, not {format}")
    size = n * dtype.size
    count = scalar("u32", n)
    cuda = format is ArtifactFormat.CUDA_SOURCE

    def entries(document_entries: Iterable[RegistryEntry]) -> list[RegistryEntry]:
        return [entry for entry in document_entries if entry.format is format]

    saxpy_entry = _entry(entries(saxpy(dtype).registry.entries), "saxpy")
    sum_entry = _entry(entries(reduce_sum(dtype).registry.entries), "partial_sum")
    three_stage = prefix_sum(dtype, method="three_stage")
    scan_entry = _entry(entries(three_stage.registry.entries), "block_scan")
    a = scalar("f32" if dtype is DType.F32 else "f64", 2.0)
    kernels = (
        KernelTuningProblem(
            name=problem_name("saxpy", dtype),
            artifact=_without_items(saxpy_entry.artifact_spec()),
            candidates=_candidates(_BLOCKS, (1, 2, 4, 8, 16)),
            buffers=(
                TuningBuffer(byte_size=size, dtype=dtype),
                TuningBuffer(byte_size=size, dtype=dtype, initial="random"),
                TuningBuffer(byte_size=size, dtype=dtype, initial="random"),
            ),
            scalars=(count, a),
        ),
        KernelTuningProblem(
            name=problem_name("partial_sum", dtype),
            artifact=_without_items(sum_entry.artifact_spec()),
            candidates=_candidates(_BLOCKS, (4, 8, 16, 32)),
            buffers=(
                TuningBuffer(byte_size=-(-n // (_BLOCKS[0] * 4)) * dtype.size, dtype=dtype),
                TuningBuffer(byte_size=size, dtype=dtype, initial="random"),
            ),
            scalars=(count,),
        ),
        KernelTuningProblem(
            name=problem_name("block_scan", dtype),
            artifact=scan_entry.artifact_spec(),
            candidates=_candidates(
                (64, *_BLOCKS), (1,), ((), ("--maxrregcount=32",)) if cuda else ((),)
            ),
            buffers=(
                TuningBuffer(byte_size=size, dtype=dtype),
                TuningBuffer(byte_size=size, dtype=dtype, initial="random"),
                TuningBuffer(byte_size=-(-n // 64) * dtype.size, dtype=dtype),
            ),
            scalars=(count,),
        ),
    )
    pipelines = [
        PipelineTuningProblem(
            name=problem_name("prefix_sum", dtype),
            candidates=tuple(prefix_sum(dtype, block, method="three_stage") for block in _BLOCKS),
            runtime_scalar_arguments=(count,),
        ),
    ]
    if dtype in SINGLE_PASS_DTYPES:
        pipelines.append(
            PipelineTuningProblem(
                name=problem_name("prefix_sum_single_pass", dtype),
                candidates=tuple(
                    prefix_sum(dtype, threads, method="single_pass", vectors=rows)
                    for threads in _SCAN_THREADS
                    for rows in _SCAN_VECTORS
                ),
                runtime_scalar_arguments=(count,),
            )
        )
    return TuningDocument(
        kernels=kernels,
        pipelines=tuple(pipelines),
        description=f"The built-in kernels over {n} {dtype.value} elements ({format.value}).",
    )
