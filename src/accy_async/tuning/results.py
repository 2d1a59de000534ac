"""What tuning measured: per-candidate statistics, the winner, and how results are applied."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Final, Literal

import msgspec

from ..backends import DeviceIdentity
from ..plan import (
    ArtifactSpec,
    CandidateMeasurement,
    KernelCallLaunch,
    KernelTuningProblem,
    LaunchTuning,
    PipelineDocument,
    PipelineTuningProblem,
    RegistryEntry,
)
from ..plan._base import Base

__all__ = [
    "CandidateResult",
    "CandidateStatus",
    "SampleStatistics",
    "TuningResult",
    "choose_winner",
    "sample_statistics",
]

CandidateStatus = Literal["ok", "failed", "skipped"]
"""``ok``: measured; ``failed``: did not compile, launch or finish in time; ``skipped``: the
time budget ran out before its turn."""

_NOTCH: Final = 1.57
"""Half-width of the median's ~95% interval is about 1.57 * IQR / sqrt(n) (McGill et al.)."""


@dataclass(frozen=True, slots=True)
class SampleStatistics:
    """The median of some samples, their interquartile range, and the median's precision."""

    median: float
    low: float
    q1: float
    q3: float
    count: int

    @property
    def relative_spread(self) -> float:
        """Interquartile range over the median."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0

    @property
    def relative_precision(self) -> float:
        """Half-width of the median's ~95% interval, over the median."""
        if self.median <= 0 or self.count == 0:
            return 0.0
        return _NOTCH * (self.q3 - self.q1) / math.sqrt(self.count) / self.median


def sample_statistics(samples: Sequence[float]) -> SampleStatistics:
    """Median, minimum and quartiles (nearest rank) of at least one sample."""
    ordered = sorted(samples)
    count = len(ordered)
    if count == 0:
        raise ValueError("statistics of no samples")

    def rank(fraction: float) -> float:
        return ordered[min(count - 1, round(fraction * (count - 1)))]

    middle = count // 2
    median = ordered[middle] if count % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return SampleStatistics(median, ordered[0], rank(0.25), rank(0.75), count)


class CandidateResult(Base, frozen=True):
    """How one candidate did. Times are seconds of device time per run."""

    index: Annotated[int, msgspec.Meta(ge=0)]
    label: str
    status: CandidateStatus
    median_seconds: float = 0.0
    min_seconds: float = 0.0
    spread: float = 0.0
    """Interquartile range over the median."""
    samples: int = 0
    compile_seconds: float = 0.0
    """Wall time to compile and load it."""
    measure_seconds: float = 0.0
    """Wall time its measurement held the device."""
    error: str = ""


def _relative_precision(candidate: CandidateResult) -> float:
    """Half-width of the candidate's median's ~95% interval, over the median."""
    if candidate.samples == 0:
        return 0.0
    return _NOTCH * candidate.spread / math.sqrt(candidate.samples)


class TuningResult(Base, frozen=True):
    """The outcome of tuning one problem on one device.

    ``winner`` is the index of the chosen candidate (``None`` when none ran);
    ``complete`` is false when the time budget skipped some candidates (such
    results are not cached); ``cached`` says it came from the tuning cache.
    """

    problem: str
    key: str
    device: DeviceIdentity
    candidates: tuple[CandidateResult, ...]
    winner: int | None
    complete: bool
    wall_seconds: float
    setup_seconds: float = 0.0
    """Wall time to generate, allocate and upload the problem's buffers."""
    cached: bool = False

    @property
    def best(self) -> CandidateResult | None:
        """The winning candidate's result."""
        return None if self.winner is None else self.candidates[self.winner]

    def _winner(self) -> int:
        if self.winner is None:
            raise LookupError(f"no candidate of {self.problem!r} ran successfully")
        return self.winner

    def launch_tuning(self, kernel_id: int) -> LaunchTuning:
        """The winner as the launch tuning of a loaded kernel.

        Build the problem's candidates in the order of the planned kernel's
        launch candidates (:func:`accy_async.tuning.candidates_from_plan`), so
        candidate indices agree.
        """
        winner = self._winner()
        return LaunchTuning(
            measurements=(
                CandidateMeasurement(
                    kernel_id=kernel_id,
                    candidate_index=winner,
                    median_ns=round(self.candidates[winner].median_seconds * 1e9),
                    sample_count=self.candidates[winner].samples,
                ),
            )
        )

    def tuned_artifact(self, problem: KernelTuningProblem) -> ArtifactSpec:
        """The problem's artifact with the winner's compile options."""
        return problem.candidate_spec(self._winner())

    def tuned_launch(self, problem: KernelTuningProblem) -> KernelCallLaunch:
        """The winner's launch rule."""
        return problem.candidates[self._winner()].launch

    def tuned_entry(self, entry: RegistryEntry, problem: KernelTuningProblem) -> RegistryEntry:
        """``entry`` (the tuned kernel's registry entry) with the winner's options and launch."""
        candidate = problem.candidates[self._winner()]
        return msgspec.structs.replace(
            entry,
            compile_options=(*entry.compile_options, *candidate.compile_options),
            launch=candidate.launch,
        )

    def tuned_document(self, problem: PipelineTuningProblem) -> PipelineDocument:
        """The winning pipeline document."""
        return problem.candidates[self._winner()]


def choose_winner(candidates: Sequence[CandidateResult], tolerance: float) -> int | None:
    """The candidate to use: the first, in declared order, within noise of the fastest.

    A candidate ties with the fastest when its median is within ``tolerance``
    (relative) of it, or within the fastest's own precision if that is wider.
    Breaking ties by declared order rather than by the noisy last digits of a
    median makes the choice repeatable across runs.
    """
    measured = [each for each in candidates if each.status == "ok"]
    if not measured:
        return None
    fastest = min(measured, key=lambda each: each.median_seconds)
    bound = fastest.median_seconds * (1.0 + max(tolerance, _relative_precision(fastest)))
    return min(each.index for each in measured if each.median_seconds <= bound)
