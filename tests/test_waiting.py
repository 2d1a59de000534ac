"""Awaiting completion: many waiters, a free event loop, cancellation that leaves nothing."""

from __future__ import annotations

import collections
import gc
import time
from typing import Any

import anyio
import pytest

import accy_async as accy
from accy_async.backends import Anticipation
from accy_async.waiting import MAX_ANTICIPATED_WAITS, CompletionLatch, wait_completion

from .conftest import EVERY_LOOP
from .kernels import GATE, load

WAITERS = 10_000


@pytest.fixture(params=EVERY_LOOP)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


class Heartbeat:
    """Ticks every millisecond and remembers the worst lateness."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.ticks = 0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - start - 0.001)
            self.ticks += 1


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
    resuming their tasks. Typical worst lags are 1-5 ms on a 2-core machine;
    a shared CI machine can stall a process for longer now and then, so the
    scenario runs up to three times and one clean run is required (every run
    must complete all 10,000 waits).
    """
    lags = []
    for _ in range(3):
        lags.append(await _ten_thousand_waits(cpu_backend))
        if lags[-1] < 0.010:
            break
    assert min(lags) < 0.010, f"worst heartbeat lags {[round(lag * 1e3, 1) for lag in lags]} ms"


async def _ten_thousand_waits(backend: accy.CpuBackend) -> float:
    """Run the burst once; return the heartbeat's worst lag in seconds."""
    gate = await load(backend, "gate")
    buffer = backend.allocate_buffer(64)
    streams = [backend.create_stream() for _ in range(4)]
    events = [backend.create_event() for _ in range(WAITERS)]
    GATE.clear()
    for stream in streams:
        backend.launch(gate, [buffer.bind()], [], (1, 1, 1), (1, 1, 1), stream=stream)
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
                    GATE.set()
                    await all_completed.wait()
                    beat.cancel_scope.cancel()
    finally:
        GATE.set()
        gc.unfreeze()
    assert completed == WAITERS
    assert heartbeat.ticks > 10
    await accy.synchronize(backend)
    backend.destroy_all([gate, buffer, *streams, *events])
    return heartbeat.worst


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
        slow, [buffer.bind()], args, (1, 1, 1), (1, 1, 1), stream=stream, signal_event=event
    )
    await accy.synchronize(backend, event=event)
    assert backend.query_event(event)
    backend.launch(slow, [buffer.bind()], args, (1, 1, 1), (1, 1, 1), stream=stream)
    await accy.synchronize(backend, stream=stream)
    assert backend.query_stream(stream)
    backend.launch(slow, [buffer.bind()], args, (1, 1, 1), (1, 1, 1))
    backend.launch(slow, [buffer.bind()], args, (1, 1, 1), (1, 1, 1), stream=stream)
    await accy.synchronize(backend)
    assert backend.query_stream() and backend.query_stream(stream)
    backend.destroy_all([slow, buffer, stream, event])


class AnticipatingRecording(accy.RecordingBackend):
    """A recording backend that predicts completions, to drive the anticipated wait."""

    def __init__(self, expected: Anticipation) -> None:
        super().__init__(completion="manual")
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


@pytest.mark.parametrize(
    ("finish_after", "patience", "polled", "called_back"),
    [
        pytest.param(0.002, 1.0, False, False, id="early: seen by a look-in while asleep"),
        pytest.param(0.06, 1.0, True, False, id="on time: seen by the loop's own polls"),
        pytest.param(0.3, 0.05, True, True, id="late: the backend's callback after the window"),
    ],
)
async def test_an_anticipated_wait_wakes_itself_polls_then_falls_back(
    finish_after: float, patience: float, polled: bool, called_back: bool
) -> None:
    now = time.perf_counter()
    # Due in 60 ms, asleep until then but for a look-in every 7.5 ms, then watched from the
    # loop for `patience` (long, so a thread starved of the GIL by the polls cannot miss it).
    backend = AnticipatingRecording(Anticipation(now + 0.06, 0.06, patience))
    event, stream = backend.create_event(), backend.create_stream()
    backend.record_event(event, stream)

    def finish() -> None:
        time.sleep(finish_after)
        backend.complete(event)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, finish)
            await accy.wait_event(backend, event)
            finished_at = time.perf_counter()
    assert finished_at - now >= finish_after
    if not polled:
        assert finished_at - now < 0.05  # a look-in saw it, before the due time
    assert (backend.queries > 20) is polled  # polled from the loop inside the window
    assert bool(backend.callbacks) is called_back  # no other thread involved unless late
    backend.destroy_all([event, stream])
    await backend.aclose()


async def test_a_cancelled_anticipated_wait_leaves_nothing_behind() -> None:
    now = time.perf_counter()
    backend = AnticipatingRecording(Anticipation(now + 0.05, 0.05, 0.01))
    event, stream = backend.create_event(), backend.create_stream()
    backend.record_event(event, stream)
    with anyio.move_on_after(0.02) as scope:
        await accy.wait_event(backend, event)
    assert scope.cancelled_caught
    assert backend.callbacks == 0
    backend.complete(event)
    backend.destroy_all([event, stream])
    await backend.aclose()


async def test_only_a_few_waits_of_a_crowd_watch_for_themselves() -> None:
    now = time.perf_counter()
    backend = AnticipatingRecording(Anticipation(now + 0.03, 0.03, 1.0))
    stream = backend.create_stream()
    events = [backend.create_event() for _ in range(MAX_ANTICIPATED_WAITS + 24)]
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
    assert len(watched) == MAX_ANTICIPATED_WAITS  # only so many polled for themselves
    assert backend.callbacks >= 24  # the crowd beyond the limit waited to be called back
    backend.destroy_all([*events, stream])
    await backend.aclose()
