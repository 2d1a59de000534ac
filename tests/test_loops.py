"""The loop layer: precise alarms, the checkpoint, callback waits, on asyncio, uvloop and trio."""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import os
import random
import statistics
import sys
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from accy_async import _loops
from accy_async._loops import _base, _clock, _trio
from accy_async.backends import Completion
from accy_async.backends._completion import ALREADY_FIRED
from accy_async.waiting import CompletionLatch

from .conftest import EVERY_LOOP


@pytest.fixture(params=EVERY_LOOP)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


async def test_alarms_fire_in_order_not_before_their_time_and_cancel() -> None:
    clock = _loops.current().clock
    assert _loops.current().clock is clock
    if sys.platform == "linux":
        assert isinstance(clock, _clock.TimerfdClock)  # the loop wakes itself, no thread
    fired: list[tuple[str, float]] = []
    done = CompletionLatch()
    start = time.perf_counter()

    def fire(name: str, due: float) -> _clock.Callback:
        def callback() -> None:
            fired.append((name, time.perf_counter() - due))
            if name == "last":
                done(None)

        return callback

    due = {"a": start + 0.004, "b": start + 0.002, "c": start + 0.003, "last": start + 0.01}
    scheduled = {name: clock.schedule(when, fire(name, when)) for name, when in due.items()}
    scheduled["c"].cancel()
    with anyio.fail_after(5):
        await done.wait()
    assert [name for name, _ in fired] == ["b", "a", "last"]
    assert all(late >= 0 for _, late in fired)


async def test_an_alarm_already_due_fires_at_once() -> None:
    done = CompletionLatch()
    _loops.current().clock.schedule(time.perf_counter() - 1.0, lambda: done(None))
    with anyio.fail_after(5):
        await done.wait()


async def test_the_alarm_fires_on_the_loops_own_thread() -> None:
    clock = _loops.current().clock
    if not clock.fires_on_loop_thread:
        pytest.skip("no timerfd here: the thread clock fires on its own thread")
    threads: list[int] = []
    done = CompletionLatch()

    def callback() -> None:
        threads.append(threading.get_ident())
        done(None)

    clock.schedule(time.perf_counter() + 0.001, callback)
    with anyio.fail_after(5):
        await done.wait()
    assert threads == [threading.get_ident()]


async def test_sleep_until_is_precise_and_cancellable() -> None:
    start = time.perf_counter()
    await _loops.sleep_until(start + 0.0005)  # the loops' own timers would round this to 1 ms
    assert time.perf_counter() - start >= 0.0005
    with anyio.move_on_after(0.001) as scope:
        await _loops.sleep_until(time.perf_counter() + 10)
    assert scope.cancelled_caught


def _bare_clock() -> _clock.AlarmClock:
    clock = _clock.ThreadClock.__new__(_clock.ThreadClock)  # no thread needed for this
    _clock.AlarmClock.__init__(clock)
    return clock


def test_the_margin_follows_the_lateness_within_its_bounds() -> None:
    clock = _bare_clock()
    for _ in range(200):
        clock.observe_lateness(10e-6)
    assert 8e-6 <= clock.margin <= 12.5e-6
    for _ in range(400):
        clock.observe_lateness(-1.0)  # early counts as on time
    assert clock.margin == 5e-6
    for _ in range(100):
        clock.observe_lateness(1.0)
    assert clock.margin == 1e-3


def test_the_margin_settles_near_the_lateness_that_one_wake_up_in_nine_exceeds() -> None:
    clock = _bare_clock()
    rng = random.Random(7)
    margins = []
    for index in range(6000):
        clock.observe_lateness(rng.uniform(0, 100e-6))
        if index >= 1000:
            margins.append(clock.margin)
    assert 80e-6 <= statistics.mean(margins) <= 96e-6  # the 89th percentile: 89 us


def test_one_preempted_wake_up_moves_the_margin_little_and_a_lasting_change_soon() -> None:
    clock = _bare_clock()
    for _ in range(300):
        clock.observe_lateness(20e-6)
    settled = clock.margin
    clock.observe_lateness(2e-3)  # the process was preempted once
    assert clock.margin <= settled * 1.21
    for _ in range(20):
        clock.observe_lateness(20e-6)
    assert clock.margin <= settled * 1.05
    for _ in range(15):
        clock.observe_lateness(250e-6)  # the machine got busy: wake-ups land later now
    assert clock.margin >= 200e-6


def test_a_missed_sleep_shrinks_the_margin_so_it_can_recover() -> None:
    clock = _bare_clock()
    for _ in range(50):
        clock.observe_lateness(500e-6)  # a burst of late wake-ups
    high = clock.margin
    for _ in range(100):
        clock.missed_a_sleep()  # waits too short to sleep in: no samples, yet it comes down
    assert clock.margin < high / 10


def test_the_thread_clock_fires_and_cancels() -> None:
    clock = _clock.ThreadClock()
    fired = threading.Event()
    cancelled = threading.Event()
    start = time.perf_counter()
    clock.schedule(start + 0.002, cancelled.set).cancel()
    clock.schedule(start + 0.003, fired.set)
    assert fired.wait(5)
    assert time.perf_counter() - start >= 0.003
    assert not cancelled.is_set()


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_without_a_timerfd_the_thread_clock_wakes_the_loop(
    library: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elsewhere than Linux (or where perf_counter is another clock) one thread fires alarms."""
    monkeypatch.setattr(_base, "timerfd_usable", lambda: False)

    async def body() -> None:
        assert isinstance(_loops.current().clock, _clock.ThreadClock)
        start = time.perf_counter()
        with anyio.fail_after(5):
            await _loops.sleep_until(start + 0.002)
        assert time.perf_counter() - start >= 0.002
        with anyio.move_on_after(0.001) as scope:
            await _loops.sleep_until(time.perf_counter() + 10)
        assert scope.cancelled_caught
        await anyio.sleep(0.005)  # a late delivery of the cancelled alarm breaks nothing

    anyio.run(body, backend=library)


@pytest.mark.skipif(sys.platform != "linux", reason="timerfd is Linux's")
def test_a_closed_loops_timerfd_is_closed() -> None:
    async def open_clock() -> int:
        clock = _loops.current().clock
        assert isinstance(clock, _clock.TimerfdClock)
        return clock.timer.fd

    loop = asyncio.new_event_loop()
    fd = loop.run_until_complete(open_clock())
    os.fstat(fd)  # open while the loop lives
    loop.close()
    del loop
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.skipif(sys.platform != "linux", reason="timerfd is Linux's")
def test_a_trio_runs_timerfd_is_closed_when_the_run_ends() -> None:
    async def open_clock() -> int:
        clock = _loops.current().clock
        assert isinstance(clock, _clock.TimerfdClock)
        return clock.timer.fd

    fd = anyio.run(open_clock, backend="trio")
    with pytest.raises(OSError):
        os.fstat(fd)


def test_outside_an_event_loop_there_is_no_loop() -> None:
    with pytest.raises(RuntimeError, match="event loop"):
        _loops.current()


async def test_the_checkpoint_yields_to_other_tasks_and_raises_cancellation() -> None:
    ran = []

    async def other() -> None:
        ran.append(True)

    async with anyio.create_task_group() as group:
        group.start_soon(other)
        for _ in range(10):  # trio runs a batch of ready tasks in random order
            await _loops.checkpoint()
            if ran:
                break
        assert ran  # the other task ran while this one yielded
    with anyio.CancelScope() as scope:
        scope.cancel()
        await _loops.checkpoint()
        pytest.fail("a cancelled scope's checkpoint raises")
    assert scope.cancelled_caught


async def test_a_callback_wait_completed_inside_register_is_still_a_checkpoint() -> None:
    def register(callback: Any) -> Any:
        callback(None)  # fires on this thread before register returns
        return ALREADY_FIRED

    with anyio.CancelScope() as scope:
        scope.cancel()
        await _loops.current().wait(register)
        pytest.fail("a cancelled scope's wait raises even when the work is done")
    assert scope.cancelled_caught
    await _loops.current().wait(register)  # and returns when not cancelled


async def test_a_callback_wait_delivers_errors_as_fresh_copies() -> None:
    fault = RuntimeError("not an accy error: delivered as itself")
    done = Completion()
    done(fault)
    with pytest.raises(RuntimeError) as caught:
        await _loops.current().wait(done.register)
    assert caught.value is fault


async def test_completions_from_many_threads_wake_their_tasks() -> None:
    latches = [CompletionLatch() for _ in range(200)]

    def fire_all() -> None:
        for latch in latches:
            latch(None)

    async with anyio.create_task_group() as group:
        for latch in latches:
            group.start_soon(latch.wait)
        await anyio.sleep(0.01)
        threads = [threading.Thread(target=fire_all) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(latch.done for latch in latches)


async def test_trio_checkpoints_are_real_ones() -> None:
    if not isinstance(_loops.current(), _trio.TrioLoop):
        pytest.skip("trio's own checkpoint rules")
    import trio.testing

    with trio.testing.assert_checkpoints():
        await _loops.checkpoint()
    done = Completion()
    done(None)
    with trio.testing.assert_checkpoints():
        await _loops.current().wait(done.register)


async def test_launches_are_admitted_a_few_per_pass_in_order() -> None:
    """Forty tasks that start launches at once: at most ADMITTED_PER_PASS per pass, in order."""
    passes = 0
    arrived: list[int] = []
    admitted: list[tuple[int, int]] = []

    async def count_passes() -> None:
        nonlocal passes
        while True:
            await _loops.checkpoint()
            passes += 1

    async def launch(index: int) -> None:
        arrived.append(index)
        await _loops.admit()
        admitted.append((index, passes))

    async with anyio.create_task_group() as group:
        group.start_soon(count_passes)
        await _loops.checkpoint()
        async with anyio.create_task_group() as launches:
            for index in range(40):
                launches.start_soon(launch, index)
        group.cancel_scope.cancel()
    assert len(admitted) == 40
    per_pass = collections.Counter(seen for _, seen in admitted)
    # trio runs a batch's tasks in random order: two batches' launches can see one count.
    slack = 2 if isinstance(_loops.current(), _trio.TrioLoop) else 1
    assert max(per_pass.values()) <= slack * _loops.ADMITTED_PER_PASS
    assert len(per_pass) >= 40 // (slack * _loops.ADMITTED_PER_PASS)
    seen = dict(admitted)
    in_arrival_order = [seen[index] for index in arrived]
    # None overtook one that came first (by more than trio's reordering within a batch).
    assert all(
        later >= earlier - (slack - 1) for earlier, later in itertools.pairwise(in_arrival_order)
    )


async def test_a_launch_cancelled_while_it_waits_for_a_pass_leaves_the_others() -> None:
    admitted: list[int] = []

    async def launch(index: int) -> None:
        await _loops.admit()
        admitted.append(index)

    async with anyio.create_task_group() as group:
        for index in range(_loops.ADMITTED_PER_PASS * 2):
            group.start_soon(launch, index)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await _loops.admit()
        assert scope.cancelled_caught
    assert sorted(admitted) == list(range(_loops.ADMITTED_PER_PASS * 2))
    assert _loops.current().free_admissions == _loops.ADMITTED_PER_PASS  # every token came back


async def test_a_launch_cancelled_after_admission_gives_its_token_back() -> None:
    """Cancelled at the admission's yield (admitted, not yet resumed): no token is lost."""
    for _ in range(_loops.ADMITTED_PER_PASS * 3):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await _loops.admit()
        assert scope.cancelled_caught
    assert _loops.current().free_admissions == _loops.ADMITTED_PER_PASS
    await _loops.admit()  # and a later launch is admitted at once
