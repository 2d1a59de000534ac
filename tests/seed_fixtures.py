"""The plans of pipeline.zig's tests: three scan stages over one operand and one result."""

from __future__ import annotations

from typing import Any

import accy_async as accy
from accy_async import plan as p
from accy_async.pipeline import PipelineLaunch


def seed_entry(
    target: str,
    argument_count: int,
    runtime_scalars: int,
    launch: p.KernelCallLaunch,
    fmt: p.ArtifactFormat = p.ArtifactFormat.CUDA_PTX,
) -> p.RegistryEntry:
    """The seed's ``pipelineTestEntry``."""
    payload: p.Payload = (
        p.CpuKernelPayload(target) if fmt is p.ArtifactFormat.CPU else p.TextPayload(f"// {target}")
    )
    return p.RegistryEntry(
        target=target,
        version=1,
        format=fmt,
        entry_name=target.rsplit(".", 1)[-1],
        argument_count=argument_count,
        payload=payload,
        launch=launch,
        runtime_scalar_argument_count=runtime_scalars,
    )


def seed_entries(fmt: p.ArtifactFormat = p.ArtifactFormat.CUDA_PTX) -> tuple[p.RegistryEntry, ...]:
    ceil_n_64 = p.CeilDiv(argument_index=0, divisor=64)
    return (
        seed_entry(
            "accy.kernel.test.block_scan",
            4,
            1,
            p.DerivedLaunch(grid=(ceil_n_64, p.Fixed(1), p.Fixed(1)), block=(64, 1, 1)),
            fmt,
        ),
        seed_entry(
            "accy.kernel.test.sums_scan",
            3,
            1,
            p.DerivedLaunch(grid=(p.Fixed(1), p.Fixed(1), p.Fixed(1)), block=(96, 1, 1)),
            fmt,
        ),
        seed_entry(
            "accy.kernel.test.add_base",
            3,
            1,
            p.DerivedLaunch(grid=(ceil_n_64, p.Fixed(1), p.Fixed(1)), block=(64, 1, 1)),
            fmt,
        ),
    )


SEED_ENTRIES = seed_entries()
SEED_REGISTRY = p.KernelCallRegistry(entries=SEED_ENTRIES)

SEED_PIPELINE = p.KernelCallPipeline(
    target="accy.kernel.test.device_scan",
    version=1,
    operand_count=1,
    result_count=1,
    runtime_scalar_argument_count=1,
    intermediates=(
        p.PipelineIntermediate(dtype=p.DType.F32, extent=p.CeilDiv(argument_index=0, divisor=64)),
        p.PipelineIntermediate(dtype=p.DType.F32, extent=p.CeilDiv(argument_index=0, divisor=64)),
    ),
    stages=(
        p.PipelineStage(
            target="accy.kernel.test.block_scan",
            version=1,
            buffers=(p.Result(0), p.Operand(0), p.Intermediate(0)),
            scalars=(p.Forward(argument_index=0),),
        ),
        p.PipelineStage(
            target="accy.kernel.test.sums_scan",
            version=1,
            buffers=(p.Intermediate(1), p.Intermediate(0)),
            scalars=(p.CeilDiv(argument_index=0, divisor=64),),
        ),
        p.PipelineStage(
            target="accy.kernel.test.add_base",
            version=1,
            buffers=(p.Result(0), p.Intermediate(1)),
            scalars=(p.Forward(argument_index=0),),
        ),
    ),
)


SEED_FORMAT = p.ArtifactFormat.CUDA_PTX
SEED_ARGUMENTS = (p.U32(5000),)


def seed_launch(**fields: Any) -> PipelineLaunch:
    """A launch of the seed pipeline in PTX over 5,000 elements; ``fields`` give the rest
    (``operands``, ``results``, ...) or replace any of those."""
    defaults: dict[str, Any] = {
        "pipeline": SEED_PIPELINE,
        "registry": SEED_REGISTRY,
        "format": SEED_FORMAT,
        "runtime_scalar_arguments": SEED_ARGUMENTS,
    }
    return PipelineLaunch(**(defaults | fields))


def seed_request(
    operand: accy.BufferHandle,
    result: accy.BufferHandle,
    scratch: accy.PipelineIntermediates,
    pool: accy.PipelineArtifactPool,
    stream: accy.StreamLike | None = None,
) -> PipelineLaunch:
    """The seed pipeline over one operand and one result (5,000 elements, PTX), with pool
    and scratch given."""
    return seed_launch(
        operands=(operand.bind("read_only"),),
        results=(result.bind(),),
        intermediates=scratch,
        artifacts=pool,
        stream=stream,
    )
