"""The CUDA trace clock's bookkeeping, against a simulated driver (no GPU needed).

A simulated stream passes its recorded events in order, as far as the test
lets it: the clock must give every stamp the device has passed its time, keep
the others pending, reuse the events it has resolved, and destroy each event
it created exactly once.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from typing import Any

import pytest

from accy_async.backends import Tracer
from accy_async.backends.cuda import _trace_clock
from accy_async.backends.cuda._trace_clock import TraceClock

_NOT_READY = 600


class _StreamFlags:
    CU_STREAM_NON_BLOCKING = 1


class _Driver:
    """What the clock calls of ``cuda.bindings.driver``: events on streams that run on demand."""

    CUstream_flags = _StreamFlags

    def __init__(self) -> None:
        self.created = 0
        self.destroyed: Counter[int] = Counter()
        self.recorded: dict[int, tuple[Any, int]] = {}  # event -> (stream, position)
        self.positions: Counter[Any] = Counter()  # stream -> events recorded on it
        self.passed: Counter[Any] = Counter()  # stream -> events the device has passed

    def run(self, stream: Any, events: int | None = None) -> None:
        """Let ``stream`` pass ``events`` more of its events (all of them with ``None``)."""
        recorded = self.positions[stream]
        self.passed[stream] = (
            recorded if events is None else min(recorded, self.passed[stream] + events)
        )

    def cuEventCreate(self, flags: int) -> tuple[int, int]:
        self.created += 1
        return 0, self.created

    def cuEventDestroy(self, event: int) -> tuple[int]:
        self.destroyed[event] += 1
        return (0,)

    def cuStreamCreate(self, flags: int) -> tuple[int, str]:
        return 0, "clock"

    def cuStreamDestroy(self, stream: Any) -> tuple[int]:
        return (0,)

    def cuEventRecord(self, event: int, stream: Any) -> tuple[int]:
        self.positions[stream] += 1
        self.recorded[event] = (stream, self.positions[stream])
        return (0,)

    def cuEventSynchronize(self, event: int) -> tuple[int]:
        self.run(self.recorded[event][0])
        return (0,)

    def cuEventQuery(self, event: int) -> tuple[int]:
        stream, position = self.recorded[event]
        return (0 if position <= self.passed[stream] else _NOT_READY,)

    def cuEventElapsedTime(self, start: int, end: int) -> tuple[int, float]:
        # a stream's n-th event is reached at n milliseconds after the reference
        return 0, float(self.recorded[end][1])


class _Record:
    """What the clock needs of a trace record."""

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.device_start_ns: int | None = None
        self.device_end_ns: int | None = None


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> _Driver:
    fake = _Driver()
    monkeypatch.setattr(_trace_clock, "driver", lambda: fake)
    return fake


def test_stamps_resolve_in_stream_order_and_events_die_once(driver: _Driver) -> None:
    clock = TraceClock(lambda result, what: None, contextlib.nullcontext)
    tracer = Tracer()
    rng = random.Random(7)
    records: list[_Record] = []
    for i in range(6000):
        record = _Record(i % 3)
        records.append(record)
        stream = f"stream {record.stream}"
        clock.stamp(stream, record, False, tracer)  # type: ignore[arg-type]
        clock.stamp(stream, record, True, tracer)  # type: ignore[arg-type]
        if rng.random() < 0.2:  # the device catches up a little, a stream at a time
            driver.run(f"stream {rng.randrange(3)}", rng.randrange(40))
        if rng.random() < 0.001:
            clock.resolve()  # an export part way
    passed = {stream: driver.passed[stream] for stream in driver.positions}
    clock.resolve()
    for index, record in enumerate(records):  # resolved exactly when the device passed it
        stream = f"stream {record.stream}"
        position = 2 * (index // 3) + 1  # its start's position on its stream
        if position + 1 <= passed[stream]:
            assert record.device_start_ns is not None and record.device_end_ns is not None
            assert record.device_end_ns - record.device_start_ns == 1_000_000  # 1 ms apart
        elif position > passed[stream]:
            assert record.device_start_ns is None and record.device_end_ns is None
    for stream in list(driver.positions):
        driver.run(stream)
    clock.resolve()
    assert all(r.device_end_ns is not None for r in records)
    assert driver.created < 2 * len(records) // 4  # resolved events were reused
    clock.close()
    assert set(driver.destroyed) == set(range(1, driver.created + 1))
    assert set(driver.destroyed.values()) == {1}
