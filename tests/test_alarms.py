"""Alarm clocks: a loop wakes itself at a precise instant, alarms fire in order, cancel cleanly."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from typing import Any

import anyio
import pytest

from accy_async import alarms
from accy_async.waiting import CompletionLatch

from .conftest import EVERY_LOOP


@pytest.fixture(params=EVERY_LOOP)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


async def test_alarms_fire_in_order_not_before_their_time_and_cancel() -> None:
    clock = alarms.alarm_clock()
    assert alarms.alarm_clock() is clock
    if sys.platform == "linux":
        assert "Timerfd" in type(clock).__name__  # the loop wakes itself, no thread
    fired: list[tuple[str, float]] = []
    done = CompletionLatch()
    start = time.perf_counter()

    def fire(name: str, due: float) -> alarms.Callback:
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
    clock = alarms.alarm_clock()
    done = CompletionLatch()
    clock.schedule(time.perf_counter() - 1.0, lambda: done(None))
    with anyio.fail_after(5):
        await done.wait()


async def test_the_alarm_fires_on_the_loops_own_thread() -> None:
    clock = alarms.alarm_clock()
    if not isinstance(clock, alarms._TimerfdClock):
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


def test_the_margin_follows_the_lateness_within_its_bounds() -> None:
    clock = alarms._ThreadClock.__new__(alarms._ThreadClock)  # no thread needed for this
    alarms.AlarmClock.__init__(clock)
    for _ in range(100):
        clock.observe_lateness(10e-6)
    assert 10e-6 <= clock.margin < 15e-6
    for _ in range(100):
        clock.observe_lateness(-1.0)  # early counts as on time
    assert clock.margin == 5e-6
    for _ in range(100):
        clock.observe_lateness(1.0)  # clipped
    assert clock.margin == 1e-3


def test_the_thread_clock_fires_and_cancels() -> None:
    clock = alarms._ThreadClock()
    fired = threading.Event()
    cancelled = threading.Event()
    start = time.perf_counter()
    clock.schedule(start + 0.002, cancelled.set).cancel()
    clock.schedule(start + 0.003, fired.set)
    assert fired.wait(5)
    assert time.perf_counter() - start >= 0.003
    assert not cancelled.is_set()


@pytest.mark.skipif(sys.platform != "linux", reason="timerfd is Linux's")
def test_a_closed_loops_timerfd_is_closed() -> None:
    async def open_clock() -> int:
        clock = alarms.alarm_clock()
        assert isinstance(clock, alarms._TimerfdClock)
        return clock._timer.fd

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
        clock = alarms.alarm_clock()
        assert isinstance(clock, alarms._TimerfdClock)
        return clock._timer.fd

    fd = anyio.run(open_clock, backend="trio")
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_missed_sleep_shrinks_the_margin_so_it_can_recover() -> None:
    clock = alarms._ThreadClock.__new__(alarms._ThreadClock)
    alarms.AlarmClock.__init__(clock)
    for _ in range(50):
        clock.observe_lateness(500e-6)  # a burst of late wake-ups
    high = clock.margin
    for _ in range(100):
        clock.missed_a_sleep()  # waits too short to sleep in: no samples, yet it comes down
    assert clock.margin < high / 10


async def test_the_thread_clock_wakes_a_sleeping_task_and_cancels_cleanly() -> None:
    clock = alarms._ThreadClock()  # what loops without a timerfd use
    start = time.perf_counter()
    with anyio.fail_after(5):
        await clock.sleep_until(start + 0.002)
    assert time.perf_counter() - start >= 0.002
    with anyio.move_on_after(0.001) as scope:
        await clock.sleep_until(time.perf_counter() + 10)
    assert scope.cancelled_caught
