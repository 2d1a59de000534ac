"""The tuner: many concurrent tuning tasks, compilation overlapped, measurement exclusive.

Every :meth:`Tuner.tune` call is a task of its own. Inside one, all
candidates are compiled at once in worker threads (at most
``compile_workers`` compilations in flight across the tuner, NVRTC being
CPU-bound), and each candidate is measured as soon as it is loaded. Measuring
holds the device's measurement lock, so timings of two tasks never overlap on
one device while their compilations do. Two tasks asking for the same key
(same device, problem and scalars) share one run; results are cached.

A sample is one run of the candidate between two timing events on the
tuning stream: device time on CUDA, the worker thread's wall clock on the
CPU backend. Before every sample, in-place buffers are restored and
(optionally) the cache is flushed, both outside the timed region. Samples are
taken in batches until the median is precise enough (``precision``) or
``max_samples`` were taken.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from .._loops import checkpoint
from ..backends import Backend, EventHandle, StreamHandle
from ..errors import AccyError, DeviceFault, LaunchArgumentMismatch, UntrustedKernel
from ..plan import KernelTuningProblem, PipelineTuningProblem, validate_plan
from ..waiting import CLEANUP_WAIT_SECONDS, release_when_idle, wait_event, wait_stream
from .cache import TuningCache, tuning_key
from .results import CandidateResult, TuningResult, choose_winner, sample_statistics
from .subjects import (
    Subject,
    Workspace,
    buffer_plan,
    create_workspace,
    load_kernel_subject,
    load_pipeline_subject,
)

__all__ = ["Tuner", "TuningProblem", "TuningProgress", "TuningSettings"]

TuningProblem = KernelTuningProblem | PipelineTuningProblem

_device_locks: weakref.WeakKeyDictionary[Backend, anyio.Lock] = weakref.WeakKeyDictionary()


def _measurement_lock(backend: Backend) -> anyio.Lock:
    """One lock per backend: measurements on a device never overlap, whichever tuner runs them."""
    lock = _device_locks.get(backend)
    if lock is None:
        lock = _device_locks[backend] = anyio.Lock()
    return lock


@dataclass(frozen=True, slots=True)
class TuningSettings:
    """How candidates are measured and chosen.

    ``warmup`` untimed runs precede the samples; samples are taken ``batch`` at
    a time, at least ``min_samples`` and at most ``max_samples``, until the
    median's ~95% interval is within ``precision`` of it. Candidates within
    ``tie_tolerance`` (or the fastest's precision, if larger) of the fastest
    tie, and the first declared wins. ``candidate_timeout`` bounds one
    candidate's measurement; ``flush_cache`` evicts the device cache before
    each sample.
    """

    warmup: int = 3
    min_samples: int = 10
    max_samples: int = 200
    batch: int = 10
    precision: float = 0.01
    tie_tolerance: float = 0.02
    candidate_timeout: float = 30.0
    flush_cache: bool = False

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_samples < 1 or self.batch < 1:
            raise LaunchArgumentMismatch("warmup >= 0, min_samples >= 1 and batch >= 1")
        if self.max_samples < self.min_samples:
            raise LaunchArgumentMismatch("max_samples must be at least min_samples")
        if self.candidate_timeout <= 0 or self.precision <= 0 or self.tie_tolerance < 0:
            raise LaunchArgumentMismatch(
                "candidate_timeout and precision must be positive, tie_tolerance not negative"
            )


@dataclass(frozen=True, slots=True)
class TuningProgress:
    """Reported after each candidate: which problem, which candidate, and how far along."""

    problem: str
    candidate: CandidateResult
    finished: int
    total: int


ProgressCallback = Callable[[TuningProgress], None]


@dataclass(eq=False)
class _SharedRun:
    """One run of a key, awaited by every task that asked for it."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    waiters: int = 0
    result: TuningResult | None = None
    error: BaseException | None = None


_NO_SKIP: Final = float("inf")


class Tuner:
    """Runs tuning problems on one backend; use as an async context manager.

    ``concurrent=False`` is the classic tuner, kept for comparison: each
    candidate is compiled and then measured before the next one is compiled,
    and :meth:`tune_all` runs problems one after another.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        settings: TuningSettings | None = None,
        cache: TuningCache | str | os.PathLike[str] | None = None,
        compile_workers: int | None = None,
        concurrent: bool = True,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.backend = backend
        self.settings = settings or TuningSettings()
        self.cache = (
            cache if cache is None or isinstance(cache, TuningCache) else TuningCache(cache)
        )
        self.concurrent = concurrent
        self._compile_workers = compile_workers or os.cpu_count() or 1
        self._compile_limiter = anyio.CapacityLimiter(
            1 if not concurrent else self._compile_workers
        )
        self._exit_stack = contextlib.AsyncExitStack()
        self._on_progress = on_progress
        self._runs: dict[str, _SharedRun] = {}
        self._task_group: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Tuner:
        self._exit_stack = contextlib.AsyncExitStack()
        async with self._exit_stack as stack:
            if self.concurrent:
                await stack.enter_async_context(
                    self.backend.parallel_compilation(self._compile_workers)
                )
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            stack = stack.pop_all()
        self._exit_stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> bool | None:
        stack, self._task_group = self._exit_stack, None
        return await stack.__aexit__(*exc_info)  # type: ignore[arg-type]

    # ----- public ---------------------------------------------------------------------------

    def key(self, problem: TuningProblem) -> str:
        """The cache key of ``problem`` on this backend's device."""
        return tuning_key(self.backend.identity, problem, flush_cache=self.settings.flush_cache)

    async def tune(self, problem: TuningProblem, *, budget: float | None = None) -> TuningResult:
        """Tune ``problem``: from the cache, from a run another task started, or a new run.

        ``budget`` (seconds) bounds the run this call starts: candidates whose
        turn comes later are ``skipped`` and the result is incomplete (and not
        cached). Cancelling the call cancels the run unless other tasks still
        wait for it. Raises :class:`DeviceFault` if the device faults,
        :class:`PlanError` for a problem that does not validate, and
        :class:`UntrustedKernel` for a candidate the backend's trust policy
        does not allow, before anything runs.
        """
        await checkpoint()
        validate_plan(problem)
        self._check_trust(problem)
        key = self.key(problem)
        if self.cache is not None:
            cached = await self.cache.aget(key)
            if cached is not None:
                return msgspec.structs.replace(cached, problem=problem.name, cached=True)
        run = self._runs.get(key)
        if run is None:
            if self._task_group is None:
                raise AccyError("use the Tuner as an async context manager (async with Tuner(...))")
            run = self._runs[key] = _SharedRun()
            self._task_group.start_soon(self._run_shared, key, run, problem, budget)
        run.waiters += 1
        try:
            await run.done.wait()
        finally:
            run.waiters -= 1
            if run.waiters == 0 and not run.done.is_set():
                run.scope.cancel()
                if self._runs.get(key) is run:
                    del self._runs[key]
        if run.error is not None:
            raise copy.copy(run.error).with_traceback(None) from run.error
        assert run.result is not None
        return msgspec.structs.replace(run.result, problem=problem.name)

    def _check_trust(self, problem: TuningProblem) -> None:
        """Refuse, before anything runs, a candidate the backend's trust policy does not allow."""
        policy = self.backend.trust_policy
        if policy is None:
            return
        formats = self.backend.formats
        if isinstance(problem, KernelTuningProblem):
            for index in range(len(problem.candidates)):
                spec = problem.candidate_spec(index)
                if spec.format in formats:
                    policy.check(spec, f"$.candidates[{index}]")
            return
        for index, candidate in enumerate(problem.candidates):
            policy.check_registry(candidate.registry, f"$.candidates[{index}].registry", formats)

    async def tune_all(
        self, problems: Sequence[TuningProblem], *, budget: float | None = None
    ) -> list[TuningResult]:
        """Tune every problem, concurrently (one after another if not ``concurrent``)."""
        await checkpoint()
        results: list[TuningResult | None] = [None] * len(problems)
        if not self.concurrent:
            for index, problem in enumerate(problems):
                results[index] = await self.tune(problem, budget=budget)
            return [each for each in results if each is not None]

        async def one(index: int, problem: TuningProblem) -> None:
            results[index] = await self.tune(problem, budget=budget)

        async with anyio.create_task_group() as group:
            for index, problem in enumerate(problems):
                group.start_soon(one, index, problem)
        return [each for each in results if each is not None]

    # ----- one run --------------------------------------------------------------------------

    async def _run_shared(
        self, key: str, run: _SharedRun, problem: TuningProblem, budget: float | None
    ) -> None:
        try:
            with run.scope:
                try:
                    run.result = await self._run(key, problem, budget)
                except Exception as exc:  # noqa: BLE001 - handed to every waiter
                    run.error = exc
        finally:
            if self._runs.get(key) is run:
                del self._runs[key]
            run.done.set()

    async def _run(self, key: str, problem: TuningProblem, budget: float | None) -> TuningResult:
        backend = self.backend
        settings = self.settings
        started = time.perf_counter()
        deadline = _NO_SKIP if budget is None else started + budget
        count = len(problem.candidates)
        results: list[CandidateResult | None] = [None] * count
        stream = backend.create_stream()
        events: list[EventHandle] = []
        workspaces: list[Workspace] = []
        setup_seconds = 0.0

        async def set_up() -> _Measurement:
            nonlocal setup_seconds
            planned = await anyio.to_thread.run_sync(buffer_plan, problem)
            async with _measurement_lock(backend):
                # Setting up writes to the device: keep it out of others' measurements.
                workspace = create_workspace(
                    backend, stream, planned, flush_cache=settings.flush_cache
                )
                workspaces.append(workspace)
                del planned
                await wait_stream(backend, stream)
            events.extend(backend.create_event(timing=True) for _ in range(2 * settings.batch))
            setup_seconds = time.perf_counter() - started
            return _Measurement(backend, stream, events, workspace, settings)

        try:
            if self.concurrent:
                await self._overlapped(problem, set_up, results, deadline)
            else:
                await self._one_after_another(problem, await set_up(), results, deadline)
        finally:
            owned = [*events, stream]
            with anyio.CancelScope(shield=True):
                for workspace in workspaces:
                    await workspace.aclose()
                await release_when_idle(backend, owned, [stream])
        final = tuple(
            each
            if each is not None
            else CandidateResult(
                index=index, label=_problem_label(problem, index), status="skipped"
            )
            for index, each in enumerate(results)
        )
        result = TuningResult(
            problem=problem.name,
            key=key,
            device=backend.identity,
            candidates=final,
            winner=choose_winner(final, settings.tie_tolerance),
            complete=all(each.status != "skipped" for each in final),
            wall_seconds=time.perf_counter() - started,
            setup_seconds=setup_seconds,
        )
        if self.cache is not None and result.complete:
            with anyio.CancelScope(shield=True):
                await self.cache.aput(key, result)
        return result

    async def _load(self, problem: TuningProblem, index: int) -> tuple[Subject | None, float, str]:
        """Compile and load a candidate; a failure to do so is returned as its message."""
        async with self._compile_limiter:
            started = time.perf_counter()
            try:
                if isinstance(problem, KernelTuningProblem):
                    subject: Subject = await load_kernel_subject(self.backend, problem, index)
                else:
                    subject = await load_pipeline_subject(self.backend, problem, index)
            except (DeviceFault, UntrustedKernel):
                raise  # a fault ends the run; an untrusted kernel is the caller's decision
            except AccyError as exc:
                return None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
            return subject, time.perf_counter() - started, ""

    async def _overlapped(
        self,
        problem: TuningProblem,
        set_up: Callable[[], Awaitable[_Measurement]],
        results: list[CandidateResult | None],
        deadline: float,
    ) -> None:
        """Compile every candidate while the buffers are set up and others are measured."""
        count = len(problem.candidates)
        stream: StreamHandle | None = None
        send, receive = anyio.create_memory_object_stream[tuple[int, Subject | None, float, str]](
            count
        )
        pending: list[Subject] = []

        async def compile_one(index: int) -> None:
            subject, seconds, error = await self._load(problem, index)
            if subject is not None:
                pending.append(subject)
            send.send_nowait((index, subject, seconds, error))

        try:
            async with anyio.create_task_group() as group:
                for index in range(count):
                    group.start_soon(compile_one, index)
                measure = await set_up()
                stream = measure.stream
                for _ in range(count):
                    index, subject, seconds, error = await receive.receive()
                    if subject is not None:
                        pending.remove(subject)
                    await self._measure_one(
                        problem, index, subject, seconds, error, measure, deadline, results
                    )
                    if time.perf_counter() >= deadline:
                        group.cancel_scope.cancel()
                        break
        finally:
            with anyio.CancelScope(shield=True):
                for subject in pending:
                    await subject.aclose(stream)
            send.close()
            receive.close()

    async def _one_after_another(
        self,
        problem: TuningProblem,
        measure: _Measurement,
        results: list[CandidateResult | None],
        deadline: float,
    ) -> None:
        """The classic way: compile a candidate, measure it, then the next."""
        for index in range(len(problem.candidates)):
            if time.perf_counter() >= deadline:
                return
            subject, seconds, error = await self._load(problem, index)
            await self._measure_one(
                problem, index, subject, seconds, error, measure, deadline, results
            )

    async def _measure_one(
        self,
        problem: TuningProblem,
        index: int,
        subject: Subject | None,
        compile_seconds: float,
        error: str,
        measure: _Measurement,
        deadline: float,
        results: list[CandidateResult | None],
    ) -> None:
        """Measure one loaded candidate (or record why it is not), into ``results``."""
        label = _problem_label(problem, index)
        if subject is None:
            result = CandidateResult(
                index=index,
                label=label,
                status="failed",
                compile_seconds=compile_seconds,
                error=error,
            )
        else:
            try:
                if time.perf_counter() >= deadline:
                    result = CandidateResult(
                        index=index, label=label, status="skipped", compile_seconds=compile_seconds
                    )
                else:
                    subject.bind(measure.workspace)
                    async with _measurement_lock(self.backend):
                        result = await measure.run(index, label, subject, compile_seconds)
            finally:
                with anyio.CancelScope(shield=True):
                    await subject.aclose(measure.stream)
        results[index] = result
        if self._on_progress is not None:
            finished = sum(each is not None for each in results)
            self._on_progress(TuningProgress(problem.name, result, finished, len(results)))


def _problem_label(problem: TuningProblem, index: int) -> str:
    """A candidate's label, or a description made from its launch and options."""
    if isinstance(problem, PipelineTuningProblem):
        document = problem.candidates[index]
        return document.pipeline.target
    candidate = problem.candidates[index]
    if candidate.label:
        return candidate.label
    try:
        x, y, z = candidate.launch.resolve(problem.scalars)[1]
        text = f"block {x}" if y == z == 1 else f"block {x}x{y}x{z}"
    except AccyError:
        text = f"candidate {index}"
    options = " ".join(candidate.compile_options)
    return f"{text} {options}" if options else text


class _Measurement:
    """Timed samples of one candidate at a time, on the tuning run's stream and events."""

    def __init__(
        self,
        backend: Backend,
        stream: StreamHandle,
        events: Sequence[EventHandle],
        workspace: Workspace,
        settings: TuningSettings,
    ) -> None:
        self.backend = backend
        self.stream = stream
        self.events = events
        self.workspace = workspace
        self.settings = settings

    async def run(
        self, index: int, label: str, subject: Subject, compile_seconds: float
    ) -> CandidateResult:
        """Warm up, then sample until precise enough; failures are returned, not raised."""
        settings = self.settings
        started = time.perf_counter()
        samples: list[float] = []
        timeout = settings.candidate_timeout
        error = ""
        with anyio.move_on_after(timeout) as scope:
            try:
                for _ in range(settings.warmup):
                    self.workspace.before_sample()
                    await subject.enqueue(self.stream)
                while len(samples) < settings.max_samples:
                    batch = min(settings.batch, settings.max_samples - len(samples))
                    for sample in range(batch):
                        self.workspace.before_sample()
                        self.backend.record_event(self.events[2 * sample], self.stream)
                        await subject.enqueue(self.stream)
                        self.backend.record_event(self.events[2 * sample + 1], self.stream)
                    await wait_event(self.backend, self.events[2 * batch - 1])
                    samples.extend(
                        self.backend.elapsed_seconds(self.events[2 * s], self.events[2 * s + 1])
                        for s in range(batch)
                    )
                    if len(samples) >= settings.min_samples:
                        statistics = sample_statistics(samples)
                        if statistics.relative_precision <= settings.precision:
                            break
            except (DeviceFault, UntrustedKernel):
                raise  # a fault ends the run; an untrusted kernel is the caller's decision
            except AccyError as exc:
                error = f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            error = f"timed out after {timeout:g} s"
        if error:
            # Whatever was enqueued must finish before the next candidate is timed.
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_WAIT_SECONDS):
                await wait_stream(self.backend, self.stream)
            return CandidateResult(
                index=index,
                label=label,
                status="failed",
                compile_seconds=compile_seconds,
                measure_seconds=time.perf_counter() - started,
                samples=len(samples),
                error=error,
            )
        statistics = sample_statistics(samples)
        return CandidateResult(
            index=index,
            label=label,
            status="ok",
            median_seconds=statistics.median,
            min_seconds=statistics.low,
            spread=statistics.relative_spread,
            samples=statistics.count,
            compile_seconds=compile_seconds,
            measure_seconds=time.perf_counter() - started,
        )
