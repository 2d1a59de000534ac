"""Hypothesis strategies for valid plans of every kind."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from accy_async import plan as p

names = st.from_regex(r"[a-z][a-z0-9_]{0,10}(\.[a-z][a-z0-9_]{0,10}){0,3}", fullmatch=True)
versions = st.integers(0, 2**32 - 1)
u32 = st.integers(0, 2**32 - 1)
argument_indices = st.integers(0, 31)

scalars: st.SearchStrategy[p.ScalarArgument] = st.one_of(
    st.builds(p.U32, u32),
    st.builds(p.I32, st.integers(-(2**31), 2**31 - 1)),
    st.builds(p.U64, st.integers(0, 2**64 - 1)),
    st.builds(p.I64, st.integers(-(2**63), 2**63 - 1)),
    st.builds(p.F32, st.floats(width=32, allow_nan=False, allow_infinity=False)),
    st.builds(p.F64, st.floats(allow_nan=False, allow_infinity=False)),
)

dtypes = st.sampled_from(list(p.DType))
blocks = st.tuples(st.integers(1, 16), st.integers(1, 8), st.integers(1, 8))
geometries = st.builds(
    p.LaunchGeometry,
    grid=st.tuples(st.integers(1, 2**31 - 1), st.integers(1, 65535), st.integers(1, 65535)),
    block=blocks,
    shared_memory_bytes=st.integers(0, 48 * 1024),
)


def quantities(
    argument_count: int,
    fixed_values: st.SearchStrategy[int] | None = None,
    divisors: st.SearchStrategy[int] | None = None,
) -> st.SearchStrategy[p.Quantity]:
    fixed = st.builds(p.Fixed, st.integers(1, 2**40) if fixed_values is None else fixed_values)
    return _of_arguments(fixed, argument_count, divisors)


def derivations(
    argument_count: int,
    constants: st.SearchStrategy[p.ScalarArgument] | None = None,
    divisors: st.SearchStrategy[int] | None = None,
) -> st.SearchStrategy[p.ScalarDerivation]:
    constant = st.builds(p.Constant, scalars if constants is None else constants)
    return _of_arguments(constant, argument_count, divisors)


def _of_arguments(
    fixed: st.SearchStrategy[Any], argument_count: int, divisors: st.SearchStrategy[int] | None
) -> st.SearchStrategy[Any]:
    """``fixed``, or a runtime scalar forwarded or divided (by one of ``divisors``)."""
    if argument_count == 0:
        return fixed
    index = st.integers(0, argument_count - 1)
    return st.one_of(
        fixed,
        st.builds(p.Forward, argument_index=index),
        st.builds(
            p.CeilDiv,
            argument_index=index,
            divisor=st.integers(1, 2**32) if divisors is None else divisors,
        ),
    )


launches = st.one_of(
    st.builds(p.FixedLaunch, geometry=geometries),
    st.builds(
        p.DerivedLaunch,
        grid=st.tuples(quantities(4), quantities(4), quantities(4)),
        block=blocks,
    ),
)

formats = st.sampled_from(list(p.ArtifactFormat))


@st.composite
def payloads(draw: st.DrawFn, fmt: p.ArtifactFormat) -> p.Payload:
    if fmt is p.ArtifactFormat.CPU:
        return p.CpuKernelPayload(draw(names))
    if fmt is p.ArtifactFormat.CUDA_CUBIN:
        return p.BinaryPayload(draw(st.binary(min_size=1, max_size=64)))
    return p.TextPayload(draw(st.text(min_size=1, max_size=64)))


@st.composite
def registry_entries(draw: st.DrawFn, target: str | None = None) -> p.RegistryEntry:
    fmt = draw(formats)
    argument_count = draw(st.integers(0, 32))
    return p.RegistryEntry(
        target=target or draw(names),
        version=draw(versions),
        format=fmt,
        entry_name=draw(names),
        argument_count=argument_count,
        runtime_scalar_argument_count=draw(st.integers(0, argument_count)),
        payload=draw(payloads(fmt)),
        launch=draw(launches),
        required_dtypes=tuple(draw(st.lists(dtypes, max_size=3))),
        compile_options=tuple(draw(st.lists(st.sampled_from(["-O3", "-DBLOCK=64"]), max_size=2))),
    )


registries = st.lists(
    registry_entries(), max_size=4, unique_by=lambda e: (e.target, e.version, e.format)
).map(lambda entries: p.KernelCallRegistry(entries=tuple(entries)))


@st.composite
def pipelines(draw: st.DrawFn) -> p.KernelCallPipeline:
    operand_count = draw(st.integers(0, 4))
    result_count = draw(st.integers(0, 4))
    scalar_count = draw(st.integers(0, 4))
    intermediates = tuple(
        draw(
            st.lists(
                st.builds(p.PipelineIntermediate, dtype=dtypes, extent=quantities(scalar_count)),
                max_size=3,
            )
        )
    )
    refs: list[st.SearchStrategy[Any]] = []
    if operand_count:
        refs.append(st.builds(p.Operand, st.integers(0, operand_count - 1)))
    if result_count:
        refs.append(st.builds(p.Result, st.integers(0, result_count - 1)))
    if intermediates:
        refs.append(st.builds(p.Intermediate, st.integers(0, len(intermediates) - 1)))
    buffer_refs = st.lists(st.one_of(*refs), max_size=4) if refs else st.just([])
    stages = draw(
        st.lists(
            st.builds(
                p.PipelineStage,
                target=names,
                version=versions,
                buffers=buffer_refs.map(tuple),
                scalars=st.lists(derivations(scalar_count), max_size=3).map(tuple),
            ),
            min_size=1,
            max_size=4,
        )
    )
    bounds = []
    for index in (
        draw(st.lists(st.integers(0, scalar_count - 1), max_size=2)) if scalar_count else []
    ):
        low = draw(st.integers(0, 100))
        bounds.append(
            p.RuntimeScalarBound(argument_index=index, min=low, max=draw(st.integers(low, 2**32)))
        )
    return p.KernelCallPipeline(
        target=draw(names),
        version=draw(versions),
        stages=tuple(stages),
        operand_count=operand_count,
        result_count=result_count,
        runtime_scalar_argument_count=scalar_count,
        runtime_scalar_types=tuple(draw(st.sampled_from([(), ("u32",) * scalar_count]))),
        runtime_scalar_bounds=tuple(bounds),
        intermediates=intermediates,
    )


@st.composite
def artifact_plans(draw: st.DrawFn) -> p.ArtifactPlan:
    slot_ids = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=6, unique=True))
    slots = tuple(
        p.Slot(
            slot_id=slot_id,
            byte_size=draw(st.one_of(st.none(), st.integers(0, 2**40))),
            dtype=draw(st.one_of(st.none(), dtypes)),
        )
        for slot_id in slot_ids
    )
    kernels = []
    kernel_ids = draw(st.lists(st.integers(0, 10_000), max_size=4, unique=True))
    for kernel_id in kernel_ids:
        inputs = tuple(draw(st.lists(st.sampled_from(slot_ids), max_size=3)))
        runtime_count = draw(st.integers(0, 3))
        mode: p.ElementCountArgument = draw(
            st.sampled_from(["none", "scalar_u32", "device_buffer_u32"])
        )
        fmt = draw(formats)
        kernels.append(
            p.PlannedKernel(
                kernel_id=kernel_id,
                work_item_id=draw(st.integers(0, 100)),
                artifact=p.ArtifactSpec(
                    kernel_name=draw(names),
                    format=fmt,
                    payload=draw(payloads(fmt)),
                    argument_count=8,
                    scalar_argument_count=draw(st.integers(0, 4)),
                ),
                output_slot_id=draw(st.sampled_from(slot_ids)),
                input_slot_ids=inputs,
                output_fill_pattern=draw(st.one_of(st.none(), u32)),
                scratch_fill_pattern=draw(st.one_of(st.none(), u32)) if inputs else None,
                element_count_argument=mode,
                element_count_argument_value=draw(u32),
                runtime_scalar_argument_count=runtime_count,
                runtime_scalar_defaults=tuple(
                    draw(st.lists(scalars, min_size=runtime_count, max_size=runtime_count))
                ),
                static_arguments=tuple(draw(st.lists(scalars, max_size=3))),
                launch_resources=p.LaunchResources(
                    geometry=draw(geometries),
                    candidates=tuple(
                        draw(
                            st.lists(st.builds(p.LaunchCandidate, geometry=geometries), max_size=3)
                        )
                    ),
                ),
                kernel_call_launch=draw(st.one_of(st.none(), launches)),
            )
        )
    return p.ArtifactPlan(slots=slots, kernels=tuple(kernels))


@st.composite
def launch_graphs(draw: st.DrawFn, kernel_count: int = 3) -> p.LaunchGraphPlan:
    node_count = draw(st.integers(1, 8))
    stream_count = draw(st.integers(0, 3))
    event_count = draw(st.integers(0, 3))
    nodes = tuple(
        p.GraphNode(
            kernel_index=draw(st.integers(0, max(0, kernel_count - 1))),
            stream=draw(st.one_of(st.none(), st.integers(0, stream_count - 1)))
            if stream_count
            else None,
            wait_events=tuple(draw(st.lists(st.integers(0, event_count - 1), max_size=2)))
            if event_count
            else (),
            signal_event=draw(st.one_of(st.none(), st.integers(0, event_count - 1)))
            if event_count
            else None,
            runtime_scalar_arguments=tuple(draw(st.lists(scalars, max_size=2))),
        )
        for _ in range(node_count)
    )
    pairs = draw(
        st.lists(
            st.tuples(st.integers(0, node_count - 1), st.integers(0, node_count - 1)).filter(
                lambda pair: pair[0] < pair[1]
            ),
            unique=True,
            max_size=6,
        )
    )
    dependencies = tuple(
        p.GraphDependency(producer_node_index=a, consumer_node_index=b) for a, b in pairs
    )
    loops: tuple[p.GraphLoop, ...] = ()
    if draw(st.booleans()):
        first = draw(st.integers(0, node_count - 1))
        loops = (
            p.GraphLoop(
                first_node_index=first,
                node_count=draw(st.integers(1, node_count - first)),
                trip_count=draw(st.integers(0, 9)),
                carries=(p.LoopCarry(input_slot_id=1, output_slot_id=2, initial_slot_id=3),),
            ),
        )
    return p.LaunchGraphPlan(
        nodes=nodes,
        dependencies=dependencies,
        loops=loops,
        stream_count=stream_count,
        event_count=event_count,
    )


documents = st.one_of(
    st.builds(p.PipelineDocument, pipeline=pipelines(), registry=registries),
    st.builds(
        p.LaunchGraphDocument,
        artifact_plan=artifact_plans(),
        graph=st.one_of(st.none(), launch_graphs()),
    ),
)
