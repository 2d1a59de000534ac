"""Tuning problems: what to tune, over which candidates, on which buffers (plans, not code).

A :class:`KernelTuningProblem` times one kernel over candidates that differ in
launch geometry and in compile options (defines, ``-maxrregcount``, ...). A
:class:`PipelineTuningProblem` times whole pipelines end to end, one candidate
per pipeline document: stages of a pipeline are coupled (a scan's block size
decides how many block sums the next stage reads), so a pipeline is tuned as a
whole, not stage by stage. Both round-trip through JSON and MessagePack like
every plan; :class:`TuningDocument` is the file ``accy-async tune`` reads.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from ._base import Base, Name, plan_error
from .geometry import KernelCallLaunch
from .registry import ArtifactSpec, CompileOption, check_compile_options
from .scalars import DType, ScalarArgument

__all__ = [
    "MAX_TUNING_BUFFER_BYTES",
    "MAX_TUNING_CANDIDATES",
    "KernelTuningProblem",
    "TuningBuffer",
    "TuningCandidate",
]

MAX_TUNING_CANDIDATES: Final = 256
MAX_TUNING_BUFFER_BYTES: Final = 2**36
"""Largest buffer a tuning problem may ask for (64 GiB); the backend's limits apply too."""


class TuningCandidate(Base, frozen=True):
    """One way to run a kernel: a launch rule and compile options added to the artifact's.

    ``launch`` is resolved against the problem's scalars, so a
    :class:`~accy_async.plan.DerivedLaunch` sizes its grid from them.
    """

    launch: KernelCallLaunch
    compile_options: tuple[CompileOption, ...] = ()
    label: Annotated[str, msgspec.Meta(max_length=256)] = ""

    def __post_init__(self) -> None:
        check_compile_options(self.compile_options)


class TuningBuffer(Base, frozen=True):
    """A buffer the kernel is timed on.

    ``initial`` says what it holds before the first run (``random``: values in
    [0, 1) for floats, 0..99 for integers, from a fixed seed). A ``restore``
    buffer is rewritten with its initial contents before every sample, outside
    the timed region, for kernels that update it in place.
    """

    byte_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TUNING_BUFFER_BYTES)]
    dtype: DType = DType.F32
    initial: Literal["zeros", "random"] = "zeros"
    restore: bool = False


class KernelTuningProblem(Base, frozen=True):
    """Tune one kernel: its artifact, the candidates, and the arguments it is timed with.

    ``buffers`` and ``scalars`` are the kernel's arguments in order; their
    counts must match the artifact's. The scalars are also the problem's size:
    results are cached per set of scalars.
    """

    name: Name
    artifact: ArtifactSpec
    candidates: Annotated[
        tuple[TuningCandidate, ...], msgspec.Meta(min_length=1, max_length=MAX_TUNING_CANDIDATES)
    ]
    buffers: tuple[TuningBuffer, ...] = ()
    scalars: tuple[ScalarArgument, ...] = ()

    def __post_init__(self) -> None:
        artifact = self.artifact
        if len(self.buffers) != artifact.buffer_argument_count:
            raise plan_error(
                f"{len(self.buffers)} buffers for a kernel that takes "
                f"{artifact.buffer_argument_count}",
                "buffers",
            )
        if len(self.scalars) != artifact.scalar_argument_count:
            raise plan_error(
                f"{len(self.scalars)} scalars for a kernel that takes "
                f"{artifact.scalar_argument_count}",
                "scalars",
            )
        total = sum(buffer.byte_size for buffer in self.buffers)
        if total > MAX_TUNING_BUFFER_BYTES:
            raise plan_error(
                f"buffers of {total} bytes in all exceed {MAX_TUNING_BUFFER_BYTES}", "buffers"
            )

    def candidate_spec(self, index: int) -> ArtifactSpec:
        """The artifact of candidate ``index``: the problem's, with its compile options added."""
        extra = self.candidates[index].compile_options
        if not extra:
            return self.artifact
        return msgspec.structs.replace(
            self.artifact, compile_options=(*self.artifact.compile_options, *extra)
        )
