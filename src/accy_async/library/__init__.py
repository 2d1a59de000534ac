"""Built-in kernels and the pipelines over them, each in CUDA C and as a CPU function.

* :func:`prefix_sum`: inclusive prefix sum, for any ``n``: in one pass with
  decoupled look-back for 4-byte types (``prefix_sum_f32``, ``prefix_sum_i32``),
  or in three stages (block scan, scan of the block totals, add the block
  offsets), the portable reference (``prefix_sum_*_three_stage``);
* :func:`saxpy`: ``out = a * x + y``;
* :func:`reduce_sum`: the sum of ``n`` elements in two stages.

Each builder returns a :class:`~accy_async.plan.PipelineDocument` holding the
pipeline and a registry with a CPU and a CUDA C entry per stage. The common
ones also ship as plan files (``accy_async/library/plans/*.json``), which
:func:`load_builtin` reads and ``accy-async run NAME`` runs.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Final

from ..plan import DType, PipelineDocument, decode_json
from . import cpu
from .builders import SINGLE_PASS_DTYPES, ScanMethod, cuda_source, prefix_sum, reduce_sum, saxpy
from .cpu import SUPPORTED_DTYPES
from .tuning import DEFAULT_TUNING_N, tuning_document

__all__ = [
    "BUILTIN_PLANS",
    "DEFAULT_TUNING_N",
    "SINGLE_PASS_DTYPES",
    "SUPPORTED_DTYPES",
    "ScanMethod",
    "builtin_document",
    "cuda_source",
    "load_builtin",
    "prefix_sum",
    "reduce_sum",
    "saxpy",
    "tuning_document",
]

BUILTIN_PLANS: Final = {
    "prefix_sum_f32": lambda: prefix_sum(DType.F32, 256),
    "prefix_sum_i32": lambda: prefix_sum(DType.I32, 256),
    "prefix_sum_f32_three_stage": lambda: prefix_sum(DType.F32, 256, method="three_stage"),
    "prefix_sum_i32_three_stage": lambda: prefix_sum(DType.I32, 256, method="three_stage"),
    "prefix_sum_f32_b64": lambda: prefix_sum(DType.F32, 64, method="three_stage"),
    "saxpy_f32": lambda: saxpy(DType.F32),
    "sum_f32": lambda: reduce_sum(DType.F32),
}
"""The plans shipped as files, by name, and the builder call that makes each."""


def builtin_document(name: str) -> PipelineDocument:
    """Build the shipped plan ``name`` (see :data:`BUILTIN_PLANS`)."""
    try:
        return BUILTIN_PLANS[name]()
    except KeyError:
        raise KeyError(f"no built-in plan {name!r}; there are {sorted(BUILTIN_PLANS)}") from None


@cache
def load_builtin(name: str) -> PipelineDocument:
    """Decode the shipped plan file ``name`` (``prefix_sum_f32``, ...)."""
    if name not in BUILTIN_PLANS:
        raise KeyError(f"no built-in plan {name!r}; there are {sorted(BUILTIN_PLANS)}")
    data = (resources.files(__package__) / "plans" / f"{name}.json").read_bytes()
    document: PipelineDocument = decode_json(data, PipelineDocument)
    return document


_ = cpu  # registers the CPU kernels on import
