"""A pipeline checked against its registry, and what runtime scalars decide for it.

A :class:`Program` is a chain checked once against a registry in one format
(cached per pipeline and registry); :func:`resolve_program` types and checks
the runtime scalars and works out each stage's scalars and geometry and the
scratch sizes (a :class:`Resolution`, cached per program). Every launch of
:mod:`accy_async.pipeline` goes through both; that module re-exports the
public names.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any, Final, TypeAlias

from ._cache import IdentityCache
from .backends import Backend, LaunchConfig
from .errors import InvalidArtifact, LaunchArgumentMismatch, UnsupportedOperation
from .plan import (
    ArtifactFormat,
    CeilDiv,
    Constant,
    Fixed,
    FixedLaunch,
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
from .plan._base import Tagged
from .plan.geometry import MAX_GRID_X, MAX_GRID_YZ, Quantity
from .plan.scalars import F32_MAX, F64, SCALAR_CLASSES, integer_value

__all__ = [
    "Picker",
    "Program",
    "Resolution",
    "choose_format",
    "intermediate_byte_size",
    "program_of",
    "resolve_program",
    "resolve_step_by_step",
    "stage_pickers",
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
    pickers: tuple[Picker, ...]
    """Per stage, its buffers picked from the operands, results and scratch in one tuple."""
    resolved: OrderedDict[tuple[ScalarArgument | int | float, ...], Resolution]
    resolver: _Resolver
    """Resolves scalars not seen before (the plan laid out once): see :class:`_Resolver`."""


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
    """Per stage, each buffer as ``(source, index)`` (the pipeline's; launches use ``pickers``)."""
    pickers: tuple[Picker, ...]
    """Per stage, a function of ``(*operands, *results, *intermediates)`` giving its buffers."""


Picker: TypeAlias = Callable[[Sequence[Any]], tuple[Any, ...]]
"""A stage's buffers picked from a launch's buffers laid end to end."""


def stage_pickers(
    refs: tuple[tuple[tuple[int, int], ...], ...], operand_count: int, result_count: int
) -> tuple[Picker, ...]:
    """Each stage's buffers as one call on ``(*operands, *results, *intermediates)``."""
    offsets = (0, operand_count, operand_count + result_count)
    pickers: list[Picker] = []
    for stage in refs:
        places = [offsets[source] + index for source, index in stage]
        if len(places) >= 2:
            pickers.append(itemgetter(*places))
        elif places:
            pickers.append(partial(_one, places[0]))
        else:
            pickers.append(_none)
    return tuple(pickers)


def _one(place: int, flat: Sequence[Any]) -> tuple[Any, ...]:
    return (flat[place],)


def _none(flat: Sequence[Any]) -> tuple[Any, ...]:
    return ()


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
    pickers = stage_pickers(refs, pipeline.operand_count, pipeline.result_count)
    return _programs.put(
        (pipeline, registry),
        Program(
            pipeline,
            registry,
            format,
            entries,
            refs,
            pickers,
            OrderedDict(),
            _Resolver(pipeline, entries, refs, pickers),
        ),
        format,
    )


def resolve_program(
    program: Program, arguments: Sequence[ScalarArgument | int | float]
) -> Resolution:
    """What ``arguments`` decide for ``program``, cached (see :func:`resolve_launch`)."""
    key = tuple(arguments)
    resolver = program.resolver
    cached = program.resolved.get(key)
    if cached is not None and (not resolver.takes_floats or _same_zeros(cached, key)):
        return cached
    typed = resolver.typed(key)
    if typed is None:  # something the quick typing leaves to the plan's own checks
        arguments, values = program.pipeline.validate_runtime_scalar_arguments(key), None
    else:
        arguments, values = typed
    if arguments != key:
        # Plain numbers: 5, 5.0 and True are equal keys, so they are never stored; the
        # typed arguments they make are.
        cached = program.resolved.get(arguments)
        if cached is not None and (not resolver.takes_floats or _same_zeros(cached, arguments)):
            return cached
    resolved = None if values is None else resolver.resolve(arguments, values)
    if resolved is None:
        resolved = resolve_step_by_step(program, arguments)
    program.resolved[arguments] = resolved
    if len(program.resolved) > _RESOLVED_CAPACITY:
        program.resolved.popitem(last=False)
    return resolved


def _same_zeros(cached: Resolution, key: tuple[ScalarArgument | int | float, ...]) -> bool:
    """Whether each float zero of ``key`` has the sign of ``cached``'s (``-0.0 == 0.0``)."""
    for typed, given in zip(cached.arguments, key, strict=True):
        value = typed.value
        if value.__class__ is float and not value:
            other = given.value if isinstance(given, Tagged) else given
            if math.copysign(1.0, value) != math.copysign(1.0, other):
                return False
    return True


def resolve_step_by_step(program: Program, arguments: tuple[ScalarArgument, ...]) -> Resolution:
    """The resolution of typed, checked ``arguments``, each step as the plan states it.

    What :class:`_Resolver` does faster for well-formed scalars; this one
    raises the error that names what does not fit.
    """
    pipeline = program.pipeline
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
    return Resolution(
        tuple(arguments),
        tuple(stage_scalars),
        tuple(configs),
        sizes,
        program.refs,
        program.pickers,
    )


_FIXED, _FORWARD, _CEIL_DIV = 0, 1, 2
"""How a quantity or scalar derivation is laid out in a :class:`_Resolver`."""

_SCALAR_CLASSES: Final = frozenset(SCALAR_CLASSES.values())
_INTEGER_CLASSES: Final = frozenset(cls for name, cls in SCALAR_CLASSES.items() if name[0] in "ui")


def _layout(quantity: Quantity | Constant) -> tuple[int, Any, int]:
    """``(kind, value or argument index, divisor)`` of a quantity or scalar derivation."""
    if isinstance(quantity, Fixed | Constant):
        return (_FIXED, quantity.value, 1)
    if isinstance(quantity, CeilDiv):
        return (_CEIL_DIV, quantity.argument_index, quantity.divisor)
    return (_FORWARD, quantity.argument_index, 1)


class _Resolver:
    """:func:`resolve_program`'s work for scalars not seen before, laid out once per program.

    A service launching every size anew resolves each: this does it with the
    plan's structure read once (each extent, derivation and grid dimension as
    a ``(kind, index, divisor)`` triple) and launch configs of values it has
    checked. It handles what is well formed only and answers ``None`` for
    anything else (a float where an int goes, a bound broken, a zero extent,
    a grid out of range), which the step-by-step path then resolves or refuses
    with its error naming the argument.
    """

    __slots__ = (
        "_bounds",
        "_count",
        "_intermediates",
        "_pickers",
        "_refs",
        "_stages",
        "_types",
        "takes_floats",
    )

    def __init__(
        self,
        pipeline: KernelCallPipeline,
        entries: Sequence[RegistryEntry],
        refs: tuple[tuple[tuple[int, int], ...], ...],
        pickers: tuple[Picker, ...],
    ) -> None:
        self._refs = refs
        self._pickers = pickers
        self._count = pipeline.runtime_scalar_argument_count
        types = pipeline.runtime_scalar_types
        self._types = tuple(SCALAR_CLASSES[name] for name in types)
        """The declared class of each argument (the first ones, or none)."""
        self.takes_floats = len(types) < self._count or any(name[0] == "f" for name in types)
        """Whether a runtime scalar may be a float (whose zero has a sign the cache must keep)."""
        self._bounds = tuple(
            (bound.argument_index, bound.min, bound.max) for bound in pipeline.runtime_scalar_bounds
        )
        self._intermediates = tuple(
            (*_layout(spec.extent), spec.dtype.size) for spec in pipeline.intermediates
        )
        stages: list[tuple[Any, ...] | None] = []
        for stage, entry in zip(pipeline.stages, entries, strict=True):
            derivations = tuple(_layout(derivation) for derivation in stage.scalars)
            launch = entry.launch
            try:
                if isinstance(launch, FixedLaunch):  # its config, made once
                    stages.append((derivations, None, LaunchConfig(*launch.resolve(()))))
                    continue
                checked = LaunchConfig((1, 1, 1), launch.block, launch.shared_memory_bytes)
            except LaunchArgumentMismatch:
                stages.append(None)  # a geometry the step-by-step path refuses, with its error
                continue
            grid = tuple(_layout(dimension) for dimension in launch.grid)
            stages.append((derivations, grid, checked))
        self._stages = tuple(stages)

    def typed(
        self, key: tuple[ScalarArgument | int | float, ...]
    ) -> tuple[tuple[ScalarArgument, ...], list[Any]] | None:
        """The arguments typed and within their bounds, with each one's int value.

        A float's value is ``None``. Answers ``None`` where the plan's own
        checks must decide (or refuse).
        """
        if len(key) != self._count:
            return None
        arguments: list[ScalarArgument] = []
        values: list[Any] = []
        types = self._types
        for index, given in enumerate(key):
            given_value: Any = given  # a plain number, or a scalar (told apart by class)
            cls: Any = given.__class__
            if cls is int and index < len(types):  # a plain int, typed as the plan declares
                cls = types[index]
                if cls not in _INTEGER_CLASSES or not cls.bounds[0] <= given_value <= cls.bounds[1]:
                    return None
                argument: ScalarArgument = cls(given_value)
            elif cls is float and index < len(types):  # a plain float, for a float scalar
                cls = types[index]
                if cls in _INTEGER_CLASSES or not (
                    math.isfinite(given_value) and (cls is F64 or abs(given_value) <= F32_MAX)
                ):
                    return None
                argument = cls(given_value)
            elif cls in _SCALAR_CLASSES and (index >= len(types) or cls is types[index]):
                argument = given_value
            else:
                return None
            arguments.append(argument)
            values.append(argument.value if cls in _INTEGER_CLASSES else None)
        for index, low, high in self._bounds:
            value = values[index]
            if (
                value is None
                or (low is not None and value < low)
                or (high is not None and value > high)
            ):
                return None
        return tuple(arguments), values

    def resolve(
        self, arguments: tuple[ScalarArgument, ...], values: list[Any]
    ) -> Resolution | None:
        """The resolution of :meth:`typed`'s answer.

        ``None`` where the step-by-step path must decide: a zero extent or one
        beyond 63 bits, a grid out of range, ...
        """
        sizes = []
        for kind, what, divisor, itemsize in self._intermediates:
            extent = _quantity(kind, what, divisor, values)
            if not extent or extent * itemsize > _MAX_BYTES:
                return None
            sizes.append(extent * itemsize)
        stage_scalars = []
        configs = []
        for stage in self._stages:
            if stage is None:
                return None
            derivations, grid, config = stage
            scalars = []
            for kind, what, divisor in derivations:
                if kind == _FIXED:
                    scalars.append(what)
                    continue
                argument = arguments[what]
                if kind == _FORWARD:
                    scalars.append(argument)
                    continue
                value = values[what]
                if value is None or value < 0:
                    return None
                scalars.append(argument.__class__(-(-value // divisor)))
            stage_scalars.append(tuple(scalars))
            if grid is None:
                configs.append(config)
                continue
            dims = []
            for kind, what, divisor in grid:
                if kind == _FIXED:
                    dims.append(what)
                    continue
                if what >= len(scalars) or scalars[what].__class__ not in _INTEGER_CLASSES:
                    return None
                value = scalars[what].value
                if value < 0:
                    return None
                dims.append(value if kind == _FORWARD else -(-value // divisor))
            x, y, z = dims
            if not (0 < x <= MAX_GRID_X and 0 < y <= MAX_GRID_YZ and 0 < z <= MAX_GRID_YZ):
                return None
            configs.append(
                LaunchConfig.unchecked((x, y, z), config.block, config.shared_memory_bytes)
            )
        return Resolution(
            arguments,
            tuple(stage_scalars),
            tuple(configs),
            tuple(sizes),
            self._refs,
            self._pickers,
        )


def _quantity(kind: int, what: int, divisor: int, values: Sequence[int | None]) -> int | None:
    """A laid-out quantity's value, or ``None`` (or 0) where the general path must decide."""
    if kind == _FIXED:
        return what
    if what >= len(values):
        return None
    value = values[what]
    if value is None or value < 0:
        return None
    return value if kind == _FORWARD else -(-value // divisor)


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
