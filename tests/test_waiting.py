"""Awaiting completion: many waiters, a free event loop, cancellation that leaves nothing."""

from __future__ import annotations

import collections
import gc
import time
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async import waiting
from accy_async.backends import Anticipation
from accy_async.testing import live_after_drain
from accy_async.waiting import (
    FRUGAL_LEARNS_EVERY,
    MAX_WATCHERS,
    CompletionLatch,
    sleep_until,
    wait_completion,
)

from .conftest import EVERY_LOOP
from .heartbeat import Heartbeat
from .kernels import GATE, load

WAITERS = 10_000


@pytest.fixture(params=EVERY_LOOP)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


async def test_ten_thousand_concurrent_waits_keep_the_loop_free(
    cpu_backend: accy.CpuBackend,
) -> None:
    """10,000 tasks wait on 10,000 events; all complete at once; the loop stays responsive.

    The events sit behind gate kernels on four streams, so every waiter is
    suspended before any completes. Python's cyclic garbage collector pauses
    in proportion to the heap, which the test itself fills with 10,000 tasks,
    so the heap built before the burst is frozen (``gc.freeze``), as a
    latency-sensitive service would do after start-up. The heartbeat then
    measures the waiting path alone: 10,000 completions crossing threads and
    resuming their tasks. Typical worst lags are 1-5 ms on a 2-core machine.
    A loaded machine (CI's, shared; or two suites at once) stretches both the
    burst (about 300 ms here) and the lags, so the bound is also relative: the
    worst lag must be under 10 ms or under a tenth of the burst; completions
    resumed all in one loop pass would stall it for nearly the whole burst. The
    scenario runs
    up to three times and one clean run is required (every run must complete
    all 10,000 waits).
    """
    runs = []
    for _ in range(3):
        runs.append(await _ten_thousand_waits(cpu_backend))
        lag, burst = runs[-1]
        if lag < max(0.010, burst / 10):
            break
    described = [f"{lag * 1e3:.1f} ms of a {burst * 1e3:.0f} ms burst" for lag, burst in runs]
    assert any(lag < max(0.010, burst / 10) for lag, burst in runs), f"worst lags: {described}"


async def _ten_thousand_waits(backend: accy.CpuBackend) -> tuple[float, float]:
    """Run the burst once; the heartbeat's worst lag and the burst's length, in seconds."""
    gate = await load(backend, "gate")
    buffer = backend.allocate_buffer(64)
    streams = [backend.create_stream() for _ in range(4)]
    events = [backend.create_event() for _ in range(WAITERS)]
    GATE.clear()
    for stream in streams:
        backend.launch(
            gate, [buffer.bind()], [], accy.LaunchConfig((1, 1, 1), (1, 1, 1)), stream=stream
        )
    for index, event in enumerate(events):
        backend.record_event(event, streams[index % 4])
    completed = 0
    all_completed = anyio.Event()
    heartbeat = Heartbeat()

    async def waiter(event: accy.EventHandle) -> None:
        nonlocal completed
        await accy.wait_event(backend, event)
        completed += 1
        if completed == WAITERS:
            all_completed.set()

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for event in events:
                    group.start_soon(waiter, event)
                await anyio.sleep(0.05)
                assert completed == 0  # every one of them is waiting
                gc.collect()
                gc.freeze()
                async with anyio.create_task_group() as beat:
                    await beat.start(heartbeat.run)
                    await anyio.sleep(0.02)
                    opened = time.perf_counter()
                    GATE.set()
                    await all_completed.wait()
                    burst = time.perf_counter() - opened
                    beat.cancel_scope.cancel()
    finally:
        GATE.set()
        gc.unfreeze()
    assert completed == WAITERS
    assert heartbeat.ticks > 10
    await accy.synchronize(backend)
    backend.destroy_all([gate, buffer, *streams, *events])
    return heartbeat.worst, burst


async def test_a_cancelled_wait_withdraws_its_callback() -> None:
    backend = accy.RecordingBackend(completion="manual")
    event, stream = backend.create_event(), backend.create_stream()
    backend.record_event(event, stream)
    registrations: list[Any] = []

    def register(callback: Any) -> Any:
        registration = backend.notify_when_complete(event, callback)
        registrations.append(registration)
        return registration

    with anyio.move_on_after(0.01) as scope:
        await wait_completion(register)
    assert scope.cancelled_caught
    assert registrations[0].cancel() is False  # already withdrawn by the cancellation
    backend.complete_all()  # a late completion reaches nobody and breaks nothing
    backend.destroy_all([event, stream])
    await backend.aclose()


async def test_sleep_until_wakes_at_its_instant_and_is_cancellable() -> None:
    for delay in (0.0003, 0.002, -1.0):  # below the selector's millisecond, above, past
        when = time.perf_counter() + delay
        with anyio.fail_after(5):
            await sleep_until(when)
        assert time.perf_counter() >= when
    with anyio.move_on_after(0.005) as scope:
        await sleep_until(time.perf_counter() + 60)
    assert scope.cancelled_caught


async def test_completion_from_another_thread_wakes_the_waiter() -> None:
    latch = CompletionLatch()

    def fire_later() -> None:
        time.sleep(0.02)
        latch(None)

    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, fire_later)
        with anyio.fail_after(5):
            await latch.wait()
    assert latch.done
    await latch.wait()  # a fired latch returns at once, any number of times


async def test_errors_reach_every_waiter_as_fresh_exceptions() -> None:
    latch = CompletionLatch()
    fault = accy.DeviceFault("illegal address")
    caught: list[BaseException] = []

    async def waiter() -> None:
        try:
            await latch.wait()
        except accy.DeviceFault as exc:
            caught.append(exc)

    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(waiter)
        await anyio.sleep(0.01)
        await anyio.to_thread.run_sync(latch, fault)
    assert len(caught) == 3
    assert len({id(exc) for exc in caught}) == 3
    assert all(exc.__cause__ is fault for exc in caught)


async def test_synchronize_has_the_seeds_three_scopes(cpu_backend: accy.CpuBackend) -> None:
    backend = cpu_backend
    slow = await load(backend, "slow_fill_f32")
    buffer = backend.allocate_buffer(64)
    stream, event = backend.create_stream(), backend.create_event()
    args: list[accy.ScalarArgument] = [accy.U32(1), accy.F32(1), accy.U64(20_000_000)]
    backend.launch(
        slow,
        [buffer.bind()],
        args,
        accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
        stream=stream,
        signal_event=event,
    )
    await accy.synchronize(backend, event=event)
    assert backend.query_event(event)
    backend.launch(
        slow, [buffer.bind()], args, accy.LaunchConfig((1, 1, 1), (1, 1, 1)), stream=stream
    )
    await accy.synchronize(backend, stream=stream)
    assert backend.query_stream(stream)
    backend.launch(slow, [buffer.bind()], args, accy.LaunchConfig((1, 1, 1), (1, 1, 1)))
    backend.launch(
        slow, [buffer.bind()], args, accy.LaunchConfig((1, 1, 1), (1, 1, 1)), stream=stream
    )
    await accy.synchronize(backend)
    assert backend.query_stream() and backend.query_stream(stream)
    backend.destroy_all([slow, buffer, stream, event])


class WatchedRecording(accy.RecordingBackend):
    """A recording backend whose completions are watched from the loop, with a set forecast.

    The test completes events from a thread (``completion="manual"``), as a
    device would, while the wait watches them; it counts the queries and the
    callbacks it is asked for.
    """

    polled_from_loop = True

    def __init__(self, expected: Anticipation | None = None, **options: Any) -> None:
        super().__init__(completion="manual", **options)
        self.expected = expected
        self.queries = 0
        self.queries_of: collections.Counter[int] = collections.Counter()
        self.callbacks = 0

    def anticipate(self, event: accy.EventHandle) -> Anticipation | None:
        return self.expected

    def _query_event(self, event: accy.EventHandle) -> bool:
        self.queries += 1
        self.queries_of[event.id] += 1
        return super()._query_event(event)

    def _notify_when_complete(self, event: accy.EventHandle, callback: Any) -> Any:
        self.callbacks += 1
        return super()._notify_when_complete(event, callback)


async def _wait_finished_by_a_thread(
    backend: WatchedRecording, after: float, policy: accy.WaitPolicy | None = None
) -> float:
    """Record an event, complete it from a thread ``after`` seconds later, wait; return when."""
    event, stream = backend.create_event(), backend.create_stream()
    backend.record_event(event, stream)
    start = time.perf_counter()

    def finish() -> None:
        time.sleep(after)
        backend.complete(event)

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, finish)
                await accy.wait_event(backend, event, policy=policy)
                finished = time.perf_counter() - start
    finally:
        backend.destroy_all([event, stream])
    assert finished >= after
    return finished


@pytest.mark.parametrize(
    ("finish_after", "spread", "tight_polls"),
    [
        # Due in 60 ms with a 6 ms spread (unsure, yet trusted): asleep but for two look-ins.
        pytest.param(0.002, 6e-3, False, id="early: seen by a look-in while asleep"),
        # Sure (a 2 ms spread), so it wakes 2 ms early and polls: robust to a loaded machine.
        pytest.param(0.06, 2e-3, True, id="on time: seen by the loop's own polls"),
        pytest.param(0.3, 0.1e-3, False, id="late: polls that adapt to the time waited"),
    ],
)
async def test_a_forecast_wait_sleeps_until_due_then_watches_from_the_loop(
    finish_after: float, spread: float, tight_polls: bool
) -> None:
    backend = WatchedRecording(Anticipation(time.perf_counter() + 0.06, spread))
    finished = await _wait_finished_by_a_thread(backend, finish_after)
    if finish_after < 0.05:
        assert finished < 0.05  # a look-in saw it, well before the due time
        assert backend.queries < 10
    if tight_polls:
        assert backend.queries > 20  # watched between checkpoints around the due time
    if finish_after > 0.1:
        # 240 ms past the due time, polled every fifth of the time waited (at most 1 ms).
        assert backend.queries < 600
    assert backend.callbacks == 0  # no other thread involved: the loop watched throughout
    await backend.aclose()


async def test_a_sure_forecast_is_slept_on_without_looking_in() -> None:
    """Due in 60 ms with a 0.1 ms spread: work that ends early is seen at the due time."""
    backend = WatchedRecording(Anticipation(time.perf_counter() + 0.06, 0.1e-3))
    finished = await _wait_finished_by_a_thread(backend, 0.002)
    assert finished > 0.05  # nobody looked: the first query came near the due time
    assert backend.queries < 10
    await backend.aclose()


async def test_a_frugal_wait_wakes_once_past_the_due_time_but_now_and_then_looks_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Work that ends early is seen by a frugal wait only past its due time (one wake-up a
    wait), but for the waits drawn to learn (about one in ``FRUGAL_LEARNS_EVERY``), which
    look in a spread before it."""
    # Below 1 / FRUGAL_LEARNS_EVERY a draw learns: the second wait only.
    draws = iter([0.9, 0.5 / FRUGAL_LEARNS_EVERY, 0.9, 1.5 / FRUGAL_LEARNS_EVERY])
    monkeypatch.setattr(waiting, "_learning_draws", SimpleNamespace(random=lambda: next(draws)))
    due, spread = 0.1, 5e-3
    early, queries = [], []
    for _ in range(4):
        backend = WatchedRecording(Anticipation(time.perf_counter() + due, spread))
        finished = await _wait_finished_by_a_thread(backend, 0.002, policy="frugal")
        early.append(finished < due)
        queries.append(backend.queries)
        await backend.aclose()
    assert early == [False, True, False, False]
    assert queries == [2, 2, 2, 2]  # the first look, then one wake-up that saw it done


async def test_without_a_forecast_the_polls_space_out_with_the_time_waited() -> None:
    counts = {}
    for policy in ("latency", "balanced", "frugal"):
        backend = WatchedRecording()
        finished = await _wait_finished_by_a_thread(backend, 0.1, policy=policy)
        assert finished < 0.1 + 0.05 + 0.5  # frugal polls at most every 5 ms (and CI is slow)
        counts[policy] = backend.queries
        assert backend.callbacks == 0
        await backend.aclose()
    # latency spins; balanced polls every fifth of the time waited (40 us..1 ms), frugal
    # every half (150 us..5 ms).
    assert counts["latency"] > counts["balanced"] > counts["frugal"]
    assert counts["balanced"] < 400
    assert counts["frugal"] < 60


async def test_a_cancelled_watching_wait_returns_at_once_and_leaves_nothing() -> None:
    now = time.perf_counter()
    backend = WatchedRecording(Anticipation(now + 0.05, 0.0))
    event, stream = backend.create_event(), backend.create_stream()
    backend.record_event(event, stream)
    for deadline in (0.01, 0.07, 0.2):  # asleep, watching tightly, polling on the clock
        start = time.perf_counter()
        with anyio.move_on_after(deadline) as scope:
            await accy.wait_event(backend, event)
        assert scope.cancelled_caught
        assert time.perf_counter() - start < deadline + 0.05
    assert backend.callbacks == 0
    backend.complete(event)
    backend.destroy_all([event, stream])
    await backend.aclose()


async def test_only_a_few_waits_of_a_crowd_watch_for_themselves() -> None:
    now = time.perf_counter()
    backend = WatchedRecording(Anticipation(now + 0.03, 0.0))
    stream = backend.create_stream()
    events = [backend.create_event() for _ in range(MAX_WATCHERS + 24)]
    for event in events:
        backend.record_event(event, stream)

    def finish() -> None:
        time.sleep(0.05)
        for event in events:
            backend.complete(event)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, finish)
            for event in events:
                group.start_soon(accy.wait_event, backend, event)
    watched = [event_id for event_id, count in backend.queries_of.items() if count > 1]
    assert len(watched) == MAX_WATCHERS  # only so many polled for themselves
    assert backend.callbacks >= 24  # the crowd beyond the limit waited to be called back
    backend.destroy_all([*events, stream])
    await backend.aclose()


async def test_wait_policies_are_checked() -> None:
    backend = accy.RecordingBackend()
    assert backend.wait_policy == "balanced"
    backend.wait_policy = "frugal"
    with pytest.raises(accy.UnsupportedOperation, match="wait policy"):
        backend.wait_policy = "fast"  # type: ignore[assignment]
    with pytest.raises(accy.UnsupportedOperation, match="wait policy"):
        accy.RecordingBackend(wait_policy="eager")  # type: ignore[arg-type]
    event = backend.create_event()
    with pytest.raises(accy.UnsupportedOperation, match="wait policy"):
        await accy.wait_event(backend, event, policy="soon")  # type: ignore[arg-type]
    backend.destroy(event)
    await backend.aclose()


@pytest.mark.parametrize("name", ["wait_event", "wait_stream", "download", "launch_pipeline"])
async def test_cancelling_a_wait_on_the_cpu_returns_at_once_and_defers_the_release(
    cpu_backend: accy.CpuBackend, name: str
) -> None:
    """Cancelled while a kernel runs, a wait returns without waiting for it; nothing is freed
    early (a pipeline's own scratch and kernels go to deferred release) or leaked."""
    backend = cpu_backend
    slow = await load(backend, "slow_fill_f32")
    buffer = backend.allocate_buffer(64)
    stream, event = backend.create_stream(), backend.create_event()
    n = 1000
    x, y = accy.upload(backend, np.ones(n, np.float32)), backend.allocate_buffer(4 * n)
    await accy.synchronize(backend)
    baseline = dict(backend.live_objects())
    document = accy.library.load_builtin("prefix_sum_f32")
    backend.launch(
        slow,
        [buffer.bind()],
        [accy.U32(1), accy.F32(1), accy.U64(500_000_000)],
        accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
        stream=stream,
        signal_event=event,
    )

    async def wait() -> None:
        if name == "wait_event":
            await accy.wait_event(backend, event)
        elif name == "wait_stream":
            await accy.wait_stream(backend, stream)
        elif name == "download":
            await accy.download(backend, buffer, np.float32, 1, stream=stream)
        else:
            await accy.launch_pipeline(
                backend,
                accy.PipelineLaunch(
                    pipeline=document.pipeline,
                    registry=document.registry,
                    format=accy.ArtifactFormat.CPU,
                    operands=[x.bind("read_only")],
                    results=[y.bind()],
                    runtime_scalar_arguments=(accy.U32(n),),
                    stream=stream,
                ),
            )

    start = time.perf_counter()
    with anyio.move_on_after(0.05) as scope:
        await wait()
    returned = time.perf_counter() - start
    assert scope.cancelled_caught
    assert returned < 0.3, f"{name} gave control back after {returned:.3f} s (kernel: 0.5 s)"
    assert await live_after_drain(backend) == baseline
    backend.destroy_all([slow, buffer, stream, event, x, y])
