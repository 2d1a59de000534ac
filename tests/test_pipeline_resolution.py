"""What runtime scalars decide for a pipeline: the quick resolver agrees with the plan's rules.

A size not seen before is resolved by a resolver laid out once per program
(``_Resolver``); anything it does not handle goes to the general path, which
refuses with the error naming the argument. These tests hold the two to the
same answers and the same errors, on the built-in plans and on random ones.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from accy_async import library
from accy_async import plan as p
from accy_async._pipeline_program import (
    Program,
    Resolution,
    program_of,
    resolve_program,
    resolve_step_by_step,
)
from accy_async.backends import LaunchConfig
from accy_async.errors import AccyError
from accy_async.plan.scalars import SCALAR_CLASSES

from . import strategies


def _strict(value: Any) -> Any:
    """``value`` with each number's type kept (``==`` takes ``F64(1)`` for ``F64(1.0)``)."""
    if isinstance(value, tuple | list):
        return tuple(_strict(each) for each in value)
    if isinstance(value, Resolution):
        fields = (value.arguments, value.stage_scalars, value.configs, value.intermediate_sizes)
        return (*_strict(fields), value.refs)
    if isinstance(value, LaunchConfig):
        return ("config", _strict(value.dims))
    if hasattr(value, "type_name"):
        return (type(value).__name__, _strict(value.value))
    return (type(value).__name__, repr(value))


def _outcome(resolve: Any) -> tuple[Any, ...]:
    """A resolution (every number with its type), or the error's kind, message and path."""
    try:
        resolution: Resolution = resolve()
    except AccyError as exc:
        return ("refused", type(exc).__name__, exc.message, exc.path)
    return ("resolved", _strict(resolution))


def _quick(program: Program, arguments: tuple[Any, ...]) -> Resolution | None:
    """The quick resolver's answer alone (no cache, no step-by-step path)."""
    typed = program.resolver.typed(arguments)
    return None if typed is None else program.resolver.resolve(*typed)


def _general(program: Program, arguments: tuple[Any, ...]) -> tuple[Any, ...]:
    """The plan's rules step by step: type and check the scalars, then resolve."""

    def resolve() -> Resolution:
        typed = program.pipeline.validate_runtime_scalar_arguments(arguments)
        return resolve_step_by_step(program, typed)

    return _outcome(resolve)


@pytest.mark.parametrize("name", sorted(library.BUILTIN_PLANS))
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 12288, 12289, 10**6 + 3, 2**32 - 1])
def test_built_in_plans_resolve_new_sizes_quickly_and_alike(name: str, n: int) -> None:
    document = library.load_builtin(name)
    pipeline = document.pipeline
    for fmt in sorted(document.registry.formats(), key=lambda each: each.value):
        program = program_of(pipeline, document.registry, fmt)
        count = pipeline.runtime_scalar_argument_count
        types = pipeline.runtime_scalar_types or ("u32",) * count
        if any(kind[0] == "f" for kind in types):
            continue  # sized plans only: a float scalar is not a size
        typed = tuple(SCALAR_CLASSES[kind](n) for kind in types)
        general = _general(program, typed)
        if general[0] == "refused":
            continue  # beyond this plan's bounds: the refusal is compared below
        quick = _quick(program, typed)
        assert quick is not None, "a well-formed size must not need the step-by-step path"
        assert _strict(quick) == general[1]
        if pipeline.runtime_scalar_types:
            plain = _quick(program, (n,) * count)
            assert plain is not None and _strict(plain) == general[1]


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ((p.U32(0),), "LimitExceeded"),  # below the plan's bound of 1
        ((0,), "LimitExceeded"),
        ((-1,), "LaunchArgumentMismatch"),  # not a u32
        ((2**32,), "LaunchArgumentMismatch"),
        ((True,), "LaunchArgumentMismatch"),
        ((5.0,), "LaunchArgumentMismatch"),
        ((p.I32(5),), "LaunchArgumentMismatch"),  # the plan declares u32
        ((p.F32(5.0),), "LaunchArgumentMismatch"),
        ((), "LaunchArgumentMismatch"),
        ((p.U32(5), p.U32(5)), "LaunchArgumentMismatch"),
    ],
)
def test_what_the_quick_resolver_does_not_handle_is_refused_by_the_plan_rules(
    arguments: tuple[Any, ...], error: str
) -> None:
    document = library.load_builtin("prefix_sum_i32")
    fmt = sorted(document.registry.formats(), key=lambda each: each.value)[0]
    program = program_of(document.pipeline, document.registry, fmt)
    assert _quick(program, arguments) is None
    outcome = _outcome(lambda: resolve_program(program, arguments))
    assert outcome == _general(program, arguments)
    assert outcome[:2] == ("refused", error)
    assert outcome[3] is not None and outcome[3].startswith("$.runtime_scalar_arguments")


def test_a_repeated_size_comes_from_the_cache_given_as_plain_ints_too() -> None:
    document = library.load_builtin("prefix_sum_i32")
    fmt = sorted(document.registry.formats(), key=lambda each: each.value)[0]
    program = program_of(document.pipeline, document.registry, fmt)
    first = resolve_program(program, (1000,))
    assert resolve_program(program, (1000,)) is first
    assert resolve_program(program, (p.U32(1000),)) is first


def test_negative_zero_is_not_taken_from_the_cache_of_zero() -> None:
    document = library.load_builtin("saxpy_f32")
    fmt = sorted(document.registry.formats(), key=lambda each: each.value)[0]
    program = program_of(document.pipeline, document.registry, fmt)
    types = document.pipeline.runtime_scalar_types
    position = types.index("f32")
    base: list[Any] = [SCALAR_CLASSES[kind](1000) for kind in types]
    for zero in (0.0, -0.0, 0.0, -0.0):
        base[position] = p.F32(zero)
        plain = tuple(zero if i == position else b for i, b in enumerate(base))
        for arguments in (tuple(base), plain):
            value = resolve_program(program, arguments).arguments[position].value
            assert math.copysign(1.0, value) == math.copysign(1.0, zero)


_TYPES = ("u32", "i32", "u64", "i64", "f32", "f64")
_numbers = st.one_of(
    st.integers(-(2**64), 2**65),
    st.integers(-5, 300),
    st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1.5, 3.5e38, 1e300]),
    st.booleans(),
)
_scalars = st.one_of(
    strategies.scalars,
    st.builds(p.U32, st.integers(0, 300)),
    st.builds(p.I32, st.integers(-5, 300)),
    st.builds(p.F32, st.integers(-5, 5)),
    st.builds(p.F64, st.sampled_from([0.0, -0.0, 1.0])),
)


_divisors = st.sampled_from([1, 3, 64, 2**32])


def _quantities(count: int) -> st.SearchStrategy[Any]:
    return strategies.quantities(
        count, st.one_of(st.integers(0, 3), st.integers(0, 2**63 - 1)), _divisors
    )


def _derivations(count: int) -> st.SearchStrategy[Any]:
    return strategies.derivations(count, _scalars, _divisors)


@st.composite
def _programs(draw: st.DrawFn) -> Program:
    """A random pipeline (every scalar type, bounds of any sign, zero extents), checked."""
    count = draw(st.integers(0, 3))
    stages, entries = [], []
    for index in range(draw(st.integers(1, 3))):
        scalars = tuple(draw(st.lists(_derivations(count), max_size=3)))
        stages.append(p.PipelineStage(target=f"t{index}", version=0, buffers=(), scalars=scalars))
        width = len(scalars)
        launch = draw(
            st.one_of(
                st.builds(p.FixedLaunch, geometry=strategies.geometries),
                st.builds(
                    p.DerivedLaunch,
                    grid=st.tuples(*[_quantities(width + 1)] * 3),
                    block=strategies.blocks,
                    shared_memory_bytes=st.integers(0, 1024),
                ),
            )
        )
        entries.append(
            p.RegistryEntry(
                target=f"t{index}",
                version=0,
                format=p.ArtifactFormat.CPU,
                entry_name="kernel",
                argument_count=width,
                runtime_scalar_argument_count=width,
                payload=p.CpuKernelPayload("kernel"),
                launch=launch,
            )
        )
    bounds = []
    for index in draw(st.lists(st.integers(0, count - 1), max_size=2)) if count else []:
        low = draw(st.one_of(st.none(), st.integers(-10, 10)))
        high = draw(st.one_of(st.none(), st.integers(-10 if low is None else low, 2**40)))
        bounds.append(p.RuntimeScalarBound(argument_index=index, min=low, max=high))
    types: Any = draw(
        st.one_of(st.just(()), st.lists(st.sampled_from(_TYPES), min_size=count, max_size=count))
    )
    try:
        pipeline = p.KernelCallPipeline(
            target="random",
            version=0,
            stages=tuple(stages),
            runtime_scalar_argument_count=count,
            runtime_scalar_types=tuple(types),
            runtime_scalar_bounds=tuple(bounds),
            intermediates=tuple(
                draw(
                    st.lists(
                        st.builds(
                            p.PipelineIntermediate,
                            dtype=strategies.dtypes,
                            extent=_quantities(count),
                        ),
                        max_size=2,
                    )
                )
            ),
        )
        return program_of(
            pipeline, p.KernelCallRegistry(entries=tuple(entries)), p.ArtifactFormat.CPU
        )
    except AccyError:
        reject()


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=_programs(), data=st.data())
def test_the_quick_resolver_agrees_with_the_plan_rules_on_random_plans(
    program: Program, data: st.DataObject
) -> None:
    count = program.pipeline.runtime_scalar_argument_count
    length = data.draw(st.sampled_from([count, count, count, count + 1, max(count - 1, 0)]))
    arguments = tuple(
        data.draw(st.lists(st.one_of(_scalars, _numbers), min_size=length, max_size=length))
    )
    quick = _quick(program, arguments)
    general = _general(program, arguments)
    if quick is not None:
        assert general == ("resolved", _strict(quick))
    assert _outcome(lambda: resolve_program(program, arguments)) == general
    assert _outcome(lambda: resolve_program(program, arguments)) == general  # from the cache
