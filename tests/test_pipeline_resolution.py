"""What runtime scalars decide for a pipeline: the quick resolver agrees with the plan's rules.

A size not seen before is resolved by a resolver laid out once per program
(``_Resolver``); anything it does not handle goes to the general path, which
refuses with the error naming the argument. These tests hold the two to the
same answers and the same errors, on the built-in plans and on random ones.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accy_async import library
from accy_async import plan as p
from accy_async._pipeline_program import (
    Program,
    Resolution,
    program_of,
    resolve_in_general,
    resolve_program,
)
from accy_async.errors import AccyError
from accy_async.plan.scalars import SCALAR_CLASSES

from . import strategies


def _outcome(resolve: Any) -> tuple[Any, ...]:
    """A resolution, or the error's kind, message and path."""
    try:
        resolution: Resolution = resolve()
    except AccyError as exc:
        return ("refused", type(exc).__name__, exc.message, exc.path)
    return ("resolved", resolution)


def _general(program: Program, arguments: tuple[Any, ...]) -> tuple[Any, ...]:
    """The plan's rules step by step: type and check the scalars, then resolve."""

    def resolve() -> Resolution:
        typed = program.pipeline.validate_runtime_scalar_arguments(arguments)
        return resolve_in_general(program, typed)

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
        quick = program.resolver(typed, program.refs)
        assert quick is not None, "a well-formed size must not need the general path"
        assert quick == general[1]
        if pipeline.runtime_scalar_types:
            assert program.resolver((n,) * count, program.refs) == general[1]  # plain ints


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
    assert program.resolver(arguments, program.refs) is None
    outcome = _outcome(lambda: resolve_program(program, arguments))
    assert outcome == _general(program, arguments)
    assert outcome[:2] == ("refused", error)
    assert outcome[3] is not None and outcome[3].startswith("$.runtime_scalar_arguments")


@st.composite
def _programs(draw: st.DrawFn) -> Program:
    """A random pipeline with a registry entry per stage (CPU format), checked."""
    pipeline = draw(strategies.pipelines())
    entries = []
    for stage in pipeline.stages:
        launch = draw(strategies.launches)
        entries.append(
            p.RegistryEntry(
                target=stage.target,
                version=stage.version,
                format=p.ArtifactFormat.CPU,
                entry_name="kernel",
                argument_count=len(stage.buffers) + len(stage.scalars),
                runtime_scalar_argument_count=len(stage.scalars),
                payload=p.CpuKernelPayload("kernel"),
                launch=launch,
            )
        )
    unique = {(entry.target, entry.version): entry for entry in entries}
    registry = p.KernelCallRegistry(entries=tuple(unique.values()))
    try:
        return program_of(pipeline, registry, p.ArtifactFormat.CPU)
    except AccyError:  # two stages of one target with different scalar counts, say
        from hypothesis import reject

        reject()


_plain_or_typed = st.one_of(
    strategies.scalars,
    st.integers(-(2**33), 2**65),
    st.integers(0, 2**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(program=_programs(), data=st.data())
def test_the_quick_resolver_agrees_with_the_plan_rules_on_random_plans(
    program: Program, data: st.DataObject
) -> None:
    count = program.pipeline.runtime_scalar_argument_count
    length = data.draw(st.sampled_from([count, count, count, count + 1, max(count - 1, 0)]))
    arguments = tuple(data.draw(st.lists(_plain_or_typed, min_size=length, max_size=length)))
    quick = program.resolver(arguments, program.refs)
    general = _general(program, arguments)
    if quick is not None:
        assert general == ("resolved", quick)
    assert _outcome(lambda: resolve_program(program, arguments)) == general
