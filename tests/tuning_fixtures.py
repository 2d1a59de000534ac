"""Tuning problems over the ``tests.tune_probe`` CPU kernel, whose fastest candidate is known."""

from __future__ import annotations

from accy_async import plan as p
from accy_async.tuning import TuningSettings

QUICK = TuningSettings(warmup=1, min_samples=5, max_samples=10, batch=5, candidate_timeout=10)
"""Few samples: the probe's candidates differ by 400 us or more."""


def fixed(block: int) -> p.FixedLaunch:
    return p.FixedLaunch(geometry=p.LaunchGeometry(grid=(1, 1, 1), block=(block, 1, 1)))


def probe_problem(
    name: str = "probe",
    blocks: tuple[int, ...] = (64, 128, 256),
    options: tuple[tuple[str, ...], ...] = ((), ("-DSLOW=1",)),
    n: int = 16,
) -> p.KernelTuningProblem:
    """Candidates ``blocks`` x ``options``; the winner is block 128 with no options."""
    return p.KernelTuningProblem(
        name=name,
        artifact=p.ArtifactSpec(
            kernel_name="tune_probe",
            format=p.ArtifactFormat.CPU,
            payload=p.CpuKernelPayload("tests.tune_probe"),
            argument_count=2,
            scalar_argument_count=1,
        ),
        candidates=tuple(
            p.TuningCandidate(launch=fixed(block), compile_options=option)
            for option in options
            for block in blocks
        ),
        buffers=(p.TuningBuffer(byte_size=4 * n, dtype=p.DType.U32, restore=True),),
        scalars=(p.scalar("u32", n),),
    )
