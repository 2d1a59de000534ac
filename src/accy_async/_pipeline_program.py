"""A pipeline checked against its registry, and what runtime scalars decide for it.

A :class:`Program` is a chain checked once against a registry in one format
(cached per pipeline and registry); :func:`resolve_program` types and checks
the runtime scalars and works out each stage's scalars and geometry and the
scratch sizes (a :class:`Resolution`, cached per program). Every launch of
:mod:`accy_async.pipeline` goes through both; that module re-exports the
public names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from ._cache import IdentityCache
from .backends import Backend, LaunchConfig
from .errors import InvalidArtifact, LaunchArgumentMismatch, UnsupportedOperation
from .plan import (
    ArtifactFormat,
    Constant,
    Forward,
    Intermediate,
    KernelCallPipeline,
    KernelCallRegistry,
    Operand,
    PipelineDocument,
    PipelineIntermediate,
    RegistryEntry,
    ScalarArgument,
    ScalarDerivation,
    resolve_quantity,
    validate_plan,
)
from .plan.scalars import SCALAR_CLASSES, integer_value

__all__ = [
    "Program",
    "Resolution",
    "choose_format",
    "intermediate_byte_size",
    "program_of",
    "resolve_program",
]

_MAX_BYTES: Final = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Program:
    """A pipeline checked against a registry in one format, with each stage's entry."""

    pipeline: KernelCallPipeline
    registry: KernelCallRegistry
    format: ArtifactFormat
    entries: tuple[RegistryEntry, ...]
    refs: tuple[tuple[tuple[int, int], ...], ...]
    """Per stage, each buffer as ``(source, index)``: 0 operand, 1 result, 2 intermediate."""
    resolved: OrderedDict[tuple[ScalarArgument | int | float, ...], Resolution]


@dataclass(frozen=True, slots=True)
class Resolution:
    """What the runtime scalars decide for one pipeline (see :func:`resolve_launch`).

    Each stage's scalars and geometry, the scratch sizes; cached per pipeline.
    """

    arguments: tuple[ScalarArgument, ...]
    """The runtime scalars, typed."""
    stage_scalars: tuple[tuple[ScalarArgument, ...], ...]
    configs: tuple[LaunchConfig, ...]
    """Each stage's launch geometry."""
    intermediate_sizes: tuple[int, ...]
    refs: tuple[tuple[tuple[int, int], ...], ...]
    """Per stage, each buffer as ``(source, index)`` (the pipeline's, kept here for launches)."""


_programs: IdentityCache[Program] = IdentityCache(128)
_RESOLVED_CAPACITY: Final = 64


def program_of(
    pipeline: KernelCallPipeline, registry: KernelCallRegistry, format: ArtifactFormat
) -> Program:
    program = _programs.get((pipeline, registry), format)
    if program is not None:
        return program
    validate_plan(pipeline)
    validate_plan(registry)
    entries = pipeline.validate(registry, format)
    refs = tuple(
        tuple(
            (
                0 if isinstance(ref, Operand) else 2 if isinstance(ref, Intermediate) else 1,
                ref.index,
            )
            for ref in stage.buffers
        )
        for stage in pipeline.stages
    )
    return _programs.put(
        (pipeline, registry),
        Program(pipeline, registry, format, entries, refs, OrderedDict()),
        format,
    )


def resolve_program(
    program: Program, arguments: Sequence[ScalarArgument | int | float]
) -> Resolution:
    key = tuple(arguments)
    cached = program.resolved.get(key)
    if cached is not None:
        return cached
    pipeline = program.pipeline
    arguments = pipeline.validate_runtime_scalar_arguments(key)
    if arguments != key:
        # Plain numbers: 5, 5.0 and True are equal keys, so they are never stored; the
        # typed arguments they make are.
        key = arguments
        cached = program.resolved.get(key)
        if cached is not None:
            return cached
    sizes = tuple(
        intermediate_byte_size(spec, arguments, index)
        for index, spec in enumerate(pipeline.intermediates)
    )
    stage_scalars = []
    configs = []
    for stage_index, (stage, entry) in enumerate(
        zip(pipeline.stages, program.entries, strict=True)
    ):
        scalars = tuple(_derive(derivation, arguments, stage_index) for derivation in stage.scalars)
        stage_scalars.append(scalars)
        configs.append(LaunchConfig(*entry.launch.resolve(scalars)))
    resolved = Resolution(
        tuple(arguments), tuple(stage_scalars), tuple(configs), sizes, program.refs
    )
    program.resolved[key] = resolved
    if len(program.resolved) > _RESOLVED_CAPACITY:
        program.resolved.popitem(last=False)
    return resolved


def _derive(
    derivation: ScalarDerivation, arguments: Sequence[ScalarArgument], stage_index: int
) -> ScalarArgument:
    if isinstance(derivation, Constant):
        return derivation.value
    argument = arguments[derivation.argument_index]
    if isinstance(derivation, Forward):
        return argument
    value = integer_value(argument)
    if value is None or value < 0:
        raise LaunchArgumentMismatch(
            f"stage {stage_index} divides runtime scalar {derivation.argument_index}, which must "
            f"be a non-negative integer, got {argument!r}",
            path=f"$.runtime_scalar_arguments[{derivation.argument_index}]",
        )
    return SCALAR_CLASSES[argument.type_name](-(-value // derivation.divisor))


def choose_format(backend: Backend, plan: PipelineDocument | KernelCallRegistry) -> ArtifactFormat:
    """The first of the backend's preferred formats that the plan's registry provides.

    What :func:`load_pipeline_artifacts` and :func:`launch_pipeline` use when
    given no format. Raises :class:`UnsupportedOperation` when the registry
    has none of them.
    """
    registry = plan.registry if isinstance(plan, PipelineDocument) else plan
    available = registry.formats()
    for candidate in backend.preferred_formats:
        if candidate in available:
            return candidate
    raise UnsupportedOperation(
        f"the plan has no kernels for the {backend.kind} backend "
        f"(it has {sorted(f.value for f in available)})"
    )


def intermediate_byte_size(
    spec: PipelineIntermediate,
    runtime_scalar_arguments: Sequence[ScalarArgument],
    index: int | None = None,
) -> int:
    """Bytes of one intermediate (the pipeline's ``index``-th) for these runtime scalars.

    Raises :class:`InvalidArtifact` when the extent is zero or the size does
    not fit in 63 bits (the seed's overflow check), naming the intermediate.
    """
    path = None if index is None else f"$.pipeline.intermediates[{index}].extent"
    extent = resolve_quantity(spec.extent, runtime_scalar_arguments)
    if extent == 0:
        raise InvalidArtifact("an intermediate resolves to zero elements", path=path)
    byte_size = extent * spec.dtype.size
    if byte_size > _MAX_BYTES:
        raise InvalidArtifact(
            f"an intermediate of {extent} {spec.dtype.value} overflows 63 bits", path=path
        )
    return byte_size
