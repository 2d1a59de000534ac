"""What a workload's row is made of: samples and their statistics, GC pauses, the clock line.

Shared by the workloads (:mod:`.completion`, :mod:`.service`, :mod:`.cancellation`):
nearest-rank percentiles, the seeded log-uniform draws, a row's summary, the
garbage collector's pauses, the host-minus-GPU clock offset interpolated over a
row, and the sections' plumbing (a row that failed says why; parts merge).
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

__all__ = [
    "SEED",
    "ClockLine",
    "GcPauses",
    "Samples",
    "Section",
    "failure",
    "guarded",
    "log_uniform",
    "merge",
    "percentile",
]

Section: TypeAlias = dict[str, dict[str, Any]]
"""Workload name -> row name -> the row (a dict), or why it is missing (a string)."""

SEED: Final = 20261201
"""Seeds every random draw (kernel lengths, request sizes), so every method sees the same."""


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value with ``fraction`` of them at or below it."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(math.ceil(fraction * len(ordered)), 1)
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class Samples:
    """What one row gathers: latencies, CPU and wall time, and the waits that went wrong."""

    latencies_us: list[float] = field(default_factory=list)
    count: int = 0
    wrong: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0

    def add(
        self,
        latency_us: float | None,
        *,
        wrong: bool = False,
        cpu_s: float = 0.0,
        wall_s: float = 0.0,
    ) -> None:
        """Count one wait; a wait without a latency (its stamp never landed) is only counted."""
        self.count += 1
        if latency_us is not None:
            self.latencies_us.append(latency_us)
        self.wrong += wrong
        self.cpu_s += cpu_s
        self.wall_s += wall_s

    def summary(self, worst_lag_s: float, pauses: GcPauses | None = None) -> dict[str, Any]:
        """The row: latency percentiles, CPU cores and per wait, heartbeat lag, wrong count.

        With ``pauses``, the garbage collector's pauses meanwhile (what else stalls a loop).
        """
        latencies = self.latencies_us
        return {
            "gc_pauses": None if pauses is None else pauses.count,
            "worst_gc_pause_ms": None if pauses is None else pauses.worst * 1e3,
            "count": self.count,
            "median_us": statistics.median(latencies) if latencies else None,
            "p90_us": percentile(latencies, 0.90) if latencies else None,
            "p99_us": percentile(latencies, 0.99) if latencies else None,
            "cpu_cores": self.cpu_s / self.wall_s if self.wall_s else None,
            "cpu_us_per_wait": self.cpu_s / self.count * 1e6 if self.count else None,
            "worst_heartbeat_lag_ms": worst_lag_s * 1e3,
            "wrong": self.wrong,
        }

    def service_summary(self, worst_lag_s: float, pauses: GcPauses | None = None) -> dict[str, Any]:
        """:meth:`summary` with the requests per second of wall time."""
        row = self.summary(worst_lag_s, pauses)
        row["requests_per_s"] = self.count / self.wall_s if self.wall_s else None
        return row


class GcPauses:
    """Within ``with``: how often Python's garbage collector ran, and its longest pause."""

    def __init__(self) -> None:
        self.count = 0
        self.worst = 0.0
        self._started = 0.0

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        del info
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.worst = max(self.worst, time.perf_counter() - self._started)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._observe)


@dataclass(frozen=True, slots=True)
class ClockLine:
    """The host-minus-GPU clock offset, calibrated at two host instants and interpolated.

    The service calibrates only while the device is idle, before and after a
    row: a calibration among 64 busy streams would queue behind their kernels
    and block the loop while the host spins for its stamp.
    """

    start_ns: int
    start_offset: int
    end_ns: int
    end_offset: int

    def offset_at(self, host_ns: int) -> float:
        """The offset at ``host_ns`` (a ``time.time_ns()``), on the line through the two."""
        if self.end_ns == self.start_ns:
            return float(self.start_offset)
        fraction = (host_ns - self.start_ns) / (self.end_ns - self.start_ns)
        return self.start_offset + fraction * (self.end_offset - self.start_offset)

    def latency_us(self, resumed_ns: int, stamp_ns: int) -> float:
        """Microseconds from a device stamp to a host resumption."""
        return (resumed_ns - stamp_ns - self.offset_at(resumed_ns)) / 1e3


def failure(exc: BaseException) -> str:
    """A row's text for a measurement that raised (the first leaf of an exception group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"failed: {type(exc).__name__}: {exc}"


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer from ``low`` to ``high`` whose logarithm is uniform."""
    return min(max(round(math.exp(rng.uniform(math.log(low), math.log(high)))), low), high)


async def guarded(
    shape: dict[str, list[str]], measure: Callable[[], Awaitable[Section]]
) -> Section:
    """``measure()``, or its rows (``shape``: workload -> row names) saying why it failed."""
    try:
        return await measure()
    except Exception as exc:  # noqa: BLE001 - a method that fails is reported, the rest run
        return {workload: dict.fromkeys(names, failure(exc)) for workload, names in shape.items()}


def merge(into: Section, part: Section) -> None:
    """Add ``part``'s rows to ``into``, workload by workload."""
    for workload, rows in part.items():
        into.setdefault(workload, {}).update(rows)
