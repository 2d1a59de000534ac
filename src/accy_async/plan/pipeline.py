"""Kernel pipelines: stages that call registry kernels on operands, results and intermediates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final, TypeAlias

import msgspec

from ..errors import AccyError, InvalidArtifact, LaunchArgumentMismatch, LimitExceeded
from ._base import ArgumentCount, ArgumentIndex, Base, Name, Tagged, Version, plan_error
from .geometry import CeilDiv, Fixed, Forward, Quantity
from .registry import ArtifactFormat, KernelCallRegistry, RegistryEntry
from .scalars import DType, ScalarArgument, ScalarType, integer_value, scalar

__all__ = [
    "BufferRef",
    "Constant",
    "Intermediate",
    "KernelCallPipeline",
    "Operand",
    "PipelineIntermediate",
    "PipelineStage",
    "Result",
    "RuntimeScalarBound",
    "ScalarDerivation",
]

_MAX_PIPELINE_STAGES: Final = 256
_MAX_INTERMEDIATES: Final = 256


class Operand(Tagged, tag="operand", kw_only=False, frozen=True):
    """The caller's operand buffer ``index`` (an input)."""

    index: ArgumentIndex


class Result(Tagged, tag="result", kw_only=False, frozen=True):
    """The caller's result buffer ``index`` (an output)."""

    index: ArgumentIndex


class Intermediate(Tagged, tag="intermediate", kw_only=False, frozen=True):
    """Scratch buffer ``index`` between stages, owned by the pipeline launch."""

    index: Annotated[int, msgspec.Meta(ge=0, lt=_MAX_INTERMEDIATES)]


BufferRef: TypeAlias = Operand | Result | Intermediate


class Constant(Tagged, tag="constant", kw_only=False, frozen=True):
    """A constant stage scalar."""

    value: ScalarArgument


ScalarDerivation: TypeAlias = Forward | CeilDiv | Constant
"""How a stage scalar comes from the pipeline's runtime scalars.

``Forward`` passes one through with its type, ``CeilDiv`` divides an integer one
rounding up (keeping its type), ``Constant`` is a fixed typed value.
"""


class PipelineIntermediate(Base, frozen=True):
    """A scratch buffer of ``extent`` elements of ``dtype``, sized per launch."""

    dtype: DType
    extent: Quantity


class PipelineStage(Base, frozen=True):
    """One kernel call: the registry entry ``(target, version)`` on these buffers and scalars."""

    target: Name
    version: Version
    buffers: tuple[BufferRef, ...]
    scalars: tuple[ScalarDerivation, ...] = ()


class RuntimeScalarBound(Base, frozen=True):
    """Inclusive bounds on integer runtime scalar ``argument_index``."""

    argument_index: ArgumentIndex
    min: int | None = None
    max: int | None = None

    def __post_init__(self) -> None:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise plan_error(f"min {self.min} exceeds max {self.max}", "min")


class KernelCallPipeline(Base, frozen=True):
    """A chain of kernel calls launched in order on one stream.

    ``operand_count`` operand and ``result_count`` result buffers come from the
    caller; ``intermediates`` are scratch buffers sized from the runtime
    scalars; ``runtime_scalar_argument_count`` typed scalars (bounded by
    ``runtime_scalar_bounds``, typed by ``runtime_scalar_types`` when given)
    parameterise every stage. Structural checks run on construction and
    decoding; :meth:`validate` checks the chain against a registry.
    """

    target: Name
    version: Version
    stages: Annotated[
        tuple[PipelineStage, ...], msgspec.Meta(min_length=1, max_length=_MAX_PIPELINE_STAGES)
    ]
    operand_count: ArgumentCount = 0
    result_count: ArgumentCount = 0
    runtime_scalar_argument_count: ArgumentCount = 0
    runtime_scalar_types: tuple[ScalarType, ...] = ()
    runtime_scalar_bounds: tuple[RuntimeScalarBound, ...] = ()
    intermediates: Annotated[
        tuple[PipelineIntermediate, ...], msgspec.Meta(max_length=_MAX_INTERMEDIATES)
    ] = ()

    def __post_init__(self) -> None:
        scalar_count = self.runtime_scalar_argument_count
        if self.runtime_scalar_types and len(self.runtime_scalar_types) != scalar_count:
            raise plan_error(
                f"{len(self.runtime_scalar_types)} runtime_scalar_types for "
                f"{scalar_count} runtime scalar arguments",
                "runtime_scalar_types",
            )
        for index, bound in enumerate(self.runtime_scalar_bounds):
            _check_argument_index(
                bound.argument_index, scalar_count, "runtime_scalar_bounds", index
            )
        for index, intermediate in enumerate(self.intermediates):
            if not isinstance(intermediate.extent, Fixed):
                _check_argument_index(
                    intermediate.extent.argument_index,
                    scalar_count,
                    "intermediates",
                    index,
                    "extent",
                )
        limits = {Operand: self.operand_count, Result: self.result_count}
        limits[Intermediate] = len(self.intermediates)
        for stage_index, stage in enumerate(self.stages):
            for ref_index, ref in enumerate(stage.buffers):
                if ref.index >= limits[type(ref)]:
                    raise plan_error(
                        f"{type(ref).__name__.lower()} {ref.index} does not exist "
                        f"(the pipeline has {limits[type(ref)]})",
                        "stages",
                        stage_index,
                        "buffers",
                        ref_index,
                        "index",
                    )
            for scalar_index, derivation in enumerate(stage.scalars):
                if not isinstance(derivation, Constant):
                    _check_argument_index(
                        derivation.argument_index,
                        scalar_count,
                        "stages",
                        stage_index,
                        "scalars",
                        scalar_index,
                    )

    def validate(
        self, registry: KernelCallRegistry, format: ArtifactFormat
    ) -> tuple[RegistryEntry, ...]:
        """Check every stage against ``registry`` in ``format``; return each stage's entry.

        Raises the first of :meth:`problems`: :class:`InvalidArtifact` when a
        stage has no entry, :class:`LaunchArgumentMismatch` when a stage's
        buffers or scalars do not fit its entry; both name the stage's path.
        """
        entries, problems = self._check(registry, format)
        if problems:
            raise problems[0]
        return tuple(entry for entry in entries if entry is not None)

    def problems(
        self, registry: KernelCallRegistry, format: ArtifactFormat
    ) -> list[InvalidArtifact | LaunchArgumentMismatch]:
        """Every way the chain fails to fit ``registry`` in ``format`` (empty: it fits)."""
        return self._check(registry, format)[1]

    def _check(
        self, registry: KernelCallRegistry, format: ArtifactFormat
    ) -> tuple[list[RegistryEntry | None], list[InvalidArtifact | LaunchArgumentMismatch]]:
        entries: list[RegistryEntry | None] = []
        problems: list[InvalidArtifact | LaunchArgumentMismatch] = []
        for stage_index, stage in enumerate(self.stages):
            entry = registry.find(stage.target, stage.version, format)
            entries.append(entry)
            if entry is None:
                problems.append(
                    InvalidArtifact(
                        f"no registry entry for {stage.target!r} version {stage.version} "
                        f"in format {format.value!r}",
                        path=f"$.stages[{stage_index}]",
                    )
                )
                continue
            if len(stage.buffers) != entry.buffer_argument_count:
                problems.append(
                    LaunchArgumentMismatch(
                        f"stage passes {len(stage.buffers)} buffers but {entry.target!r} takes "
                        f"{entry.buffer_argument_count}",
                        path=f"$.stages[{stage_index}].buffers",
                    )
                )
            if len(stage.scalars) != entry.runtime_scalar_argument_count:
                problems.append(
                    LaunchArgumentMismatch(
                        f"stage passes {len(stage.scalars)} scalars but {entry.target!r} takes "
                        f"{entry.runtime_scalar_argument_count}",
                        path=f"$.stages[{stage_index}].scalars",
                    )
                )
        return entries, problems

    def validate_runtime_scalar_arguments(
        self, arguments: Sequence[ScalarArgument | int | float]
    ) -> tuple[ScalarArgument, ...]:
        """Check the count, the declared types and the bounds of the runtime scalars.

        Plain Python numbers are accepted where the plan declares the type
        (``runtime_scalar_types``) and returned typed. Raises
        :class:`LaunchArgumentMismatch` (:class:`LimitExceeded` for a bound)
        naming the argument, before anything is allocated.
        """
        if len(arguments) != self.runtime_scalar_argument_count:
            raise LaunchArgumentMismatch(
                f"pipeline {self.target!r} takes {self.runtime_scalar_argument_count} runtime "
                f"scalar arguments, got {len(arguments)}",
                path="$.runtime_scalar_arguments",
            )
        arguments = self._typed(arguments)
        for index, (argument, type_name) in enumerate(
            zip(arguments, self.runtime_scalar_types, strict=False)
        ):
            if argument.type_name != type_name:
                raise LaunchArgumentMismatch(
                    f"runtime scalar argument {index} must be {type_name}, "
                    f"got {argument.type_name}",
                    path=f"$.runtime_scalar_arguments[{index}]",
                )
        for bound in self.runtime_scalar_bounds:
            argument = arguments[bound.argument_index]
            value = integer_value(argument)
            if value is None:
                raise LaunchArgumentMismatch(
                    f"runtime scalar argument {bound.argument_index} is bounded and must be an "
                    f"integer, got {argument.type_name}",
                    path=f"$.runtime_scalar_arguments[{bound.argument_index}]",
                )
            if (bound.min is not None and value < bound.min) or (
                bound.max is not None and value > bound.max
            ):
                raise LimitExceeded(
                    f"runtime scalar argument {bound.argument_index} = {value} is outside "
                    f"[{bound.min}, {bound.max}]",
                    path=f"$.runtime_scalar_arguments[{bound.argument_index}]",
                )
        return arguments

    def _typed(
        self, arguments: Sequence[ScalarArgument | int | float]
    ) -> tuple[ScalarArgument, ...]:
        """The arguments with plain numbers made the plan's declared scalar types."""
        typed: list[ScalarArgument] = []
        for index, argument in enumerate(arguments):
            path = f"$.runtime_scalar_arguments[{index}]"
            if isinstance(argument, Tagged):
                typed.append(argument)
                continue
            if index >= len(self.runtime_scalar_types):
                raise LaunchArgumentMismatch(
                    f"runtime scalar argument {index} is a plain {type(argument).__name__} and "
                    f"the plan declares no runtime_scalar_types: pass a typed scalar "
                    f"(accy.U32({argument!r}), ...)",
                    path=path,
                )
            type_name = self.runtime_scalar_types[index]
            try:
                typed.append(scalar(type_name, argument))
            except AccyError as exc:
                raise LaunchArgumentMismatch(
                    f"runtime scalar argument {index}: {exc.message}", path=path
                ) from None
        return tuple(typed)


def _check_argument_index(index: int, count: int, *fields: str | int) -> None:
    if index >= count:
        raise plan_error(
            f"runtime scalar argument {index} does not exist (the pipeline takes {count})",
            *fields,
            "argument_index",
        )
