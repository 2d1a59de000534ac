"""Sweeps that prove code built on accy-async loses and leaks nothing under faults and cancellation.

:func:`fault_sweep` runs a scenario once on a :class:`RecordingBackend` to count
its backend calls of each kind, then once more for every kind and every N up to
that count with the Nth such call failing: each run must raise the injected
error (or absorb it, where the library has a documented fallback), leave no
device object alive, and be followed by a clean run that passes on the same
backend.

:func:`cancellation_sweep` cancels a scenario after 0, 1, 2, ... checkpoints of
a concurrent task (an AnyIO cancel scope, a timeout, or asyncio's own
``Task.cancel()``) until the scenario finishes before the cancellation lands;
after each point the work is drained and nothing may be left alive, no task
may be left running, and the cancellation must have reached the caller.

Both return reports with the number of points tried and every problem found;
use them in your own tests (they are how accy-async's reliability figures are
made, see ``docs/reliability.md``).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import anyio
import anyio.lowlevel

from . import _loops
from .backends import Backend
from .backends.recording import FAULT_KINDS, FaultKind, RecordingBackend, fault_error
from .waiting import synchronize

__all__ = [
    "DEFAULT_FAULT_KINDS",
    "CancellationReport",
    "FaultReport",
    "SweepProblem",
    "assert_checkpoint",
    "cancellation_sweep",
    "fault_sweep",
    "live_after_drain",
]

DEFAULT_FAULT_KINDS: Final[tuple[FaultKind, ...]] = (
    "allocate",
    "create",
    "load",
    "stream",
    "event",
    "launch",
    "record",
    "write",
    "read",
    "instantiate",
    "graph_launch",
)
"""The call kinds swept by default: every kind that creates, enqueues or moves data."""

Scenario = Callable[[Backend], Awaitable[Any]]
CancelWay = Literal["scope", "timeout", "task"]


@dataclass(frozen=True, slots=True)
class SweepProblem:
    """One point of a sweep that broke a promise, and how."""

    point: str
    problem: str


@dataclass
class FaultReport:
    """What :func:`fault_sweep` tried and found."""

    scenario: str
    calls: dict[str, int]
    """Backend calls of each kind in a clean run: the Ns swept."""
    points: int = 0
    raised: int = 0
    absorbed: int = 0
    problems: list[SweepProblem] = field(default_factory=list)


@dataclass
class CancellationReport:
    """What :func:`cancellation_sweep` tried and found."""

    scenario: str
    way: CancelWay
    points: int = 0
    cancelled: int = 0
    completed: int = 0
    """Runs that finished first, or whose cancellation arrived in shielded clean-up after the
    work was done (an AnyIO scope does not raise once nothing is left to cancel)."""
    problems: list[SweepProblem] = field(default_factory=list)


async def live_after_drain(backend: Backend, *, patience: float = 10.0) -> dict[int, str]:
    """The objects still alive once queued work has finished and deferred releases ran.

    Deferred releases may wait on streams that were destroyed meanwhile (a
    graph run's own), whose last work completes a moment later: they are
    given up to ``patience`` seconds.
    """
    with anyio.move_on_after(patience):
        if backend.fault is None and not backend.closed:
            await synchronize(backend)
        backend.collect_deferred()
        while backend.deferred_count:
            await anyio.sleep(0.001)
            backend.collect_deferred()
    return dict(backend.live_objects())


async def assert_checkpoint(make: Callable[[], Awaitable[Any]]) -> None:
    """Assert that awaiting ``make()`` is a checkpoint: it yields and honours cancellation.

    trio's rule, which every public async function of accy-async keeps even
    when its work is already done. On trio this is
    ``trio.testing.assert_checkpoints``; on asyncio, ``make()`` is awaited once
    inside a cancelled scope (it must raise the cancellation) and once beside
    a task that counts its turns (it must let that task run). Raises
    :class:`AssertionError` otherwise.
    """
    if _loops.library() == "trio":
        import trio.testing

        with trio.testing.assert_checkpoints():
            await make()
        return
    with anyio.CancelScope() as scope:
        scope.cancel()
        await make()
    if not scope.cancelled_caught:
        raise AssertionError("awaited in a cancelled scope, it did not raise the cancellation")
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        group.start_soon(count_turns)
        await anyio.lowlevel.checkpoint()
        before = turns
        await make()
        yielded = turns > before
        group.cancel_scope.cancel()
    if not yielded:
        raise AssertionError("it returned without letting another task run")


def _error_matches(kind: FaultKind, error: BaseException) -> bool:
    expected = fault_error(kind)
    if isinstance(error, BaseExceptionGroup):
        return all(_error_matches(kind, each) for each in error.exceptions)
    return isinstance(error, expected) and "injected fault" in str(error)


async def fault_sweep(
    scenario: Scenario,
    *,
    name: str = "scenario",
    kinds: Sequence[FaultKind] = DEFAULT_FAULT_KINDS,
    make_backend: Callable[[], RecordingBackend] = RecordingBackend,
) -> FaultReport:
    """Fail every call of every kind in turn; see the module docstring.

    ``scenario`` gets the backend and must release what it creates itself
    (buffers it allocates, say), as correct code does; objects the library
    creates are the library's to release.
    """
    for kind in kinds:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
    counting = make_backend()
    async with counting:
        await scenario(counting)
        calls: dict[str, int] = {kind: counting.calls[kind] for kind in kinds}
        left = await live_after_drain(counting)
    report = FaultReport(scenario=name, calls=calls)
    if left:
        report.problems.append(SweepProblem("clean run", f"left alive: {left}"))
    for kind in kinds:
        for n in range(1, calls[str(kind)] + 1):
            await _fault_point(scenario, kind, n, make_backend, report)
    return report


async def _fault_point(
    scenario: Scenario,
    kind: FaultKind,
    n: int,
    make_backend: Callable[[], RecordingBackend],
    report: FaultReport,
) -> None:
    point = f"{kind} call {n}"
    report.points += 1
    backend = make_backend()
    try:
        backend.inject_fault(kind, after=n - 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            try:
                await scenario(backend)
            except Exception as exc:  # noqa: BLE001 - the sweep judges every error
                if _error_matches(kind, exc):
                    report.raised += 1
                else:
                    report.problems.append(
                        SweepProblem(point, f"raised {type(exc).__name__}: {exc}")
                    )
            else:
                report.absorbed += 1
        left = await live_after_drain(backend)
        if left:
            report.problems.append(SweepProblem(point, f"left alive: {left}"))
        if backend.fault is None:
            backend.clear_faults()
            try:
                await scenario(backend)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                report.problems.append(
                    SweepProblem(
                        point, f"the clean run after it raised {type(exc).__name__}: {exc}"
                    )
                )
            left = await live_after_drain(backend)
            if left:
                report.problems.append(SweepProblem(point, f"clean run after it left: {left}"))
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            await backend.aclose()


async def cancellation_sweep(
    scenario: Scenario,
    backend: Backend,
    *,
    name: str = "scenario",
    way: CancelWay = "scope",
    max_points: int = 1000,
    check: Callable[[Any], bool] | None = None,
) -> CancellationReport:
    """Cancel ``scenario`` after 0, 1, 2, ... checkpoints; see the module docstring.

    ``way`` is ``"scope"`` (an AnyIO cancel scope cancelled from another
    task), ``"timeout"`` (``anyio.move_on_after`` with a deadline of k
    microseconds) or ``"task"`` (asyncio's ``Task.cancel()``, asyncio only).
    ``check`` judges the result of runs that finish before the cancellation.
    """
    if way == "task" and _loops.library() != "asyncio":
        raise RuntimeError("way='task' needs asyncio")
    report = CancellationReport(scenario=name, way=way)
    baseline_objects = dict(backend.live_objects())
    baseline_tasks = len(anyio.get_running_tasks())
    for k in range(max_points):
        report.points += 1
        outcome, result = await _cancel_at(scenario, backend, way, k, report)
        point = f"{way} after {k}"
        if outcome == "completed":
            report.completed += 1
            if check is not None and not check(result):
                report.problems.append(SweepProblem(point, f"wrong result {result!r}"))
        elif outcome == "cancelled":
            report.cancelled += 1
        left = {
            key: value
            for key, value in (await live_after_drain(backend)).items()
            if key not in baseline_objects
        }
        if left:
            report.problems.append(SweepProblem(point, f"left alive: {left}"))
        await anyio.lowlevel.checkpoint()
        tasks = len(anyio.get_running_tasks())
        if tasks > baseline_tasks:
            report.problems.append(SweepProblem(point, f"{tasks - baseline_tasks} tasks left"))
        if outcome == "completed" and k > 0:
            return report
    return report


_LINEAR_POINTS: Final = 200
"""Points 0..199 cancel after that many checkpoints (or microseconds, for timeouts); later
points wait 5% longer each, from 200 us, so long scenarios are covered in a few hundred."""


def _schedule(k: int) -> tuple[int, float]:
    """``(checkpoints, extra seconds)`` to wait before cancelling at point ``k``."""
    if k < _LINEAR_POINTS:
        return k, 0.0
    return _LINEAR_POINTS, 200e-6 * 1.05 ** (k - _LINEAR_POINTS)


async def _cancel_at(
    scenario: Scenario, backend: Backend, way: CancelWay, k: int, report: CancellationReport
) -> tuple[str, Any]:
    point = f"{way} after {k}"
    checkpoints, delay = _schedule(k)
    if way == "task":
        task = asyncio.ensure_future(scenario(backend))
        for _ in range(checkpoints):
            if task.done():
                break
            await asyncio.sleep(0)
        if delay and not task.done():
            await asyncio.sleep(delay)
        if task.done():
            return "completed", task.result()
        task.cancel()
        try:
            result = await task
        except asyncio.CancelledError:
            return "cancelled", None
        except Exception as exc:  # noqa: BLE001 - a wrong error is the finding
            report.problems.append(SweepProblem(point, f"raised {type(exc).__name__}: {exc}"))
            return "error", None
        report.problems.append(SweepProblem(point, "Task.cancel() was swallowed"))
        return "swallowed", result

    box: list[Any] = []
    if way == "timeout":
        with anyio.move_on_after(checkpoints * 1e-6 + delay) as scope:
            try:
                box.append(await scenario(backend))
            except Exception as exc:  # noqa: BLE001 - a wrong error is the finding
                report.problems.append(SweepProblem(point, f"raised {type(exc).__name__}: {exc}"))
                return "error", None
    else:
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                try:
                    box.append(await scenario(backend))
                except Exception as exc:  # noqa: BLE001 - a wrong error is the finding
                    report.problems.append(
                        SweepProblem(point, f"raised {type(exc).__name__}: {exc}")
                    )

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            for _ in range(checkpoints):
                await anyio.lowlevel.checkpoint()
            if delay:
                await anyio.sleep(delay)
            scope.cancel()
    if scope.cancelled_caught:
        return "cancelled", None
    if box:
        return "completed", box[0]
    return "error", None
