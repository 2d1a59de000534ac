"""Tuning: time candidates of kernels and pipelines from concurrent tasks, cache the winners.

>>> async with accy.open_backend("auto") as backend:
...     async with Tuner(backend, cache="~/.cache/accy-async/tuning.msgpack") as tuner:
...         results = await tuner.tune_all(problems)

A problem (:class:`~accy_async.plan.KernelTuningProblem` or
:class:`~accy_async.plan.PipelineTuningProblem`) is a plan: it names the
kernel or pipelines, the candidates and the buffers they are timed on. The
:class:`TuningResult` says how each candidate did and which one won; it feeds
back as a registry entry (:meth:`TuningResult.tuned_entry`), an artifact spec
and launch rule, the launch tuning of loaded kernels
(:meth:`TuningResult.launch_tuning`) or the winning pipeline document.
"""

from __future__ import annotations

from ..plan import FixedLaunch, PlannedKernel, TuningCandidate
from .cache import TuningCache, tuning_key
from .results import CandidateResult, TuningResult, choose_winner, sample_statistics
from .tuner import Tuner, TuningProblem, TuningProgress, TuningSettings

__all__ = [
    "CandidateResult",
    "Tuner",
    "TuningCache",
    "TuningProblem",
    "TuningProgress",
    "TuningResult",
    "TuningSettings",
    "candidates_from_plan",
    "choose_winner",
    "sample_statistics",
    "tuning_key",
]


def candidates_from_plan(planned: PlannedKernel) -> tuple[TuningCandidate, ...]:
    """The launch candidates of a planned kernel as tuning candidates, in the plan's order.

    Tuning with these keeps candidate indices equal to the plan's, so
    :meth:`TuningResult.launch_tuning` selects the winner in
    :class:`~accy_async.kernels.LoadedKernels`.
    """
    return tuple(
        TuningCandidate(launch=FixedLaunch(geometry=candidate.geometry))
        for candidate in planned.launch_resources.candidates
    )
