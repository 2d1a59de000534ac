"""Predicting when recorded events complete, from when earlier ones on the stream did.

A backend tells the forecast when it records an event (:meth:`recorded`), when a
query found the record still pending (:meth:`pending_seen`) and when a record
was seen complete (:meth:`completed_seen`); :meth:`anticipate` then predicts the
next record's completion on the same stream. The duration learned is from the
record to its completion, so it includes the time the work queued behind
earlier work on the stream: a stream used the same way each time (the common
case: a pipeline or graph run again and again) is predicted well.

A completion seen by a poll right after a pending one is a measurement; one
seen late (by a callback, or by a waiter that woke after it) only bounds the
duration from above, and the forecast then moves below that bound by a step,
so the next waiter wakes early enough to measure again.
"""

from __future__ import annotations

from typing import Final

from .base import Anticipation

__all__ = ["CompletionForecast"]

MEASURED_WITHIN: Final = 30e-6
"""A completion bracketed this narrowly (pending, then complete) counts as measured."""

LATE_STEP: Final = 10e-6
"""The least a late observation moves the expectation below what it saw."""

LEAST_PATIENCE: Final = 50e-6
"""The least time a waiter watches past the due time before asking for a callback."""


_LATEST: Final = object()


class CompletionForecast:
    """Per-stream expected record-to-completion times.

    Meant for the backend's own thread; :meth:`completed_seen` may also come
    from a completion thread, with the ``record`` it watched, so that a
    completion of an older record never counts for a newer one.
    """

    __slots__ = ("_expected", "_pending_seen_at", "_recorded_at")

    def __init__(self) -> None:
        self._recorded_at: dict[int, tuple[int, float]] = {}
        self._pending_seen_at: dict[int, float] = {}
        self._expected: dict[int, float] = {}

    def recorded(self, event_id: int, stream_key: int, at: float) -> None:
        """``event_id`` was (re-)recorded on the stream ``stream_key`` at ``at``."""
        self._recorded_at[event_id] = (stream_key, at)
        self._pending_seen_at.pop(event_id, None)

    def pending_seen(self, event_id: int, at: float) -> None:
        """A query at ``at`` found the latest record of ``event_id`` pending."""
        self._pending_seen_at[event_id] = at

    def record_of(self, event_id: int) -> object:
        """A token for the latest record of ``event_id``, for :meth:`completed_seen`."""
        return self._recorded_at.get(event_id)

    def completed_seen(self, event_id: int, at: float, record: object = _LATEST) -> None:
        """The latest record of ``event_id`` (or ``record``, if given) was seen complete at ``at``.

        Only the first sighting of a record counts.
        """
        recorded = self._recorded_at.get(event_id)
        if recorded is None or (record is not _LATEST and record is not recorded):
            return
        del self._recorded_at[event_id]
        pending_at = self._pending_seen_at.pop(event_id, None)
        key, recorded_at = recorded
        upper = at - recorded_at
        lower = 0.0 if pending_at is None else max(pending_at - recorded_at, 0.0)
        expected = self._expected.get(key)
        if expected is None:
            expected = upper
        elif upper - lower <= MEASURED_WITHIN:
            expected += ((lower + upper) / 2 - expected) / 2
        elif expected > upper:
            expected = max(upper - max(LATE_STEP, upper / 20), 0.0)
        elif expected < lower:
            expected = lower
        self._expected[key] = expected

    def forget(self, event_id: int) -> None:
        """``event_id`` was destroyed."""
        self._recorded_at.pop(event_id, None)
        self._pending_seen_at.pop(event_id, None)

    def forget_stream(self, stream_key: int) -> None:
        """The stream was destroyed: its key may be reused by an unrelated stream."""
        self._expected.pop(stream_key, None)

    def anticipate(self, event_id: int) -> Anticipation | None:
        """When the latest record of ``event_id`` should complete; ``None`` if unknown."""
        recorded = self._recorded_at.get(event_id)
        if recorded is None:
            return None
        expected = self._expected.get(recorded[0])
        if expected is None:
            return None
        patience = max(expected / 4, LEAST_PATIENCE)
        return Anticipation(recorded[1] + expected, expected, patience)

    def expected(self, stream_key: int) -> float | None:
        """The current expectation for a stream, in seconds (for tests and diagnostics)."""
        return self._expected.get(stream_key)
