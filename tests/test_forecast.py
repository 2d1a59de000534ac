"""The completion forecast: what it learns from measured, late and early sightings."""

from __future__ import annotations

import pytest

from accy_async.backends.forecast import LATE_STEP, LEAST_PATIENCE, CompletionForecast

STREAM = 7


def seen(
    forecast: CompletionForecast, event: int, duration: float, pending_at: float | None = None
) -> None:
    """Record ``event`` at t=100 s and see it complete ``duration`` later."""
    forecast.recorded(event, STREAM, 100.0)
    if pending_at is not None:
        forecast.pending_seen(event, 100.0 + pending_at)
    forecast.completed_seen(event, 100.0 + duration)


def test_nothing_is_anticipated_before_a_completion_was_seen() -> None:
    forecast = CompletionForecast()
    forecast.recorded(1, STREAM, 5.0)
    assert forecast.anticipate(1) is None
    assert forecast.anticipate(2) is None  # never recorded


def test_the_first_sighting_sets_the_expectation_and_predicts_the_next_record() -> None:
    forecast = CompletionForecast()
    seen(forecast, 1, 2e-3)
    assert forecast.expected(STREAM) == pytest.approx(2e-3)
    forecast.recorded(1, STREAM, 200.0)
    expected = forecast.anticipate(1)
    assert expected is not None
    assert expected.due == pytest.approx(200.002)
    assert expected.duration == pytest.approx(2e-3)
    assert expected.patience == pytest.approx(0.5e-3)


def test_a_narrow_bracket_is_a_measurement() -> None:
    forecast = CompletionForecast()
    seen(forecast, 1, 3e-3)
    seen(forecast, 1, 2.000e-3, pending_at=1.990e-3)  # pending 10 us before: measured
    assert forecast.expected(STREAM) == pytest.approx((3e-3 + 1.995e-3) / 2)


def test_a_late_sighting_moves_below_what_it_saw() -> None:
    forecast = CompletionForecast()
    seen(forecast, 1, 3e-3)
    seen(forecast, 1, 2.5e-3)  # no pending sighting: it was done some time before 2.5 ms
    expected = forecast.expected(STREAM)
    assert expected is not None
    assert expected <= 2.5e-3 - max(LATE_STEP, 2.5e-3 / 20)


def test_a_late_sighting_after_the_expectation_changes_nothing() -> None:
    forecast = CompletionForecast()
    seen(forecast, 1, 1e-3)
    seen(forecast, 1, 2e-3)  # done by 2 ms: no news about a 1 ms expectation
    assert forecast.expected(STREAM) == pytest.approx(1e-3)


def test_work_still_pending_after_the_expectation_raises_it() -> None:
    forecast = CompletionForecast()
    seen(forecast, 1, 1e-3)
    seen(forecast, 1, 5e-3, pending_at=3e-3)  # still pending at 3 ms
    assert forecast.expected(STREAM) == pytest.approx(3e-3)


def test_only_the_first_sighting_of_a_record_counts_and_never_an_older_one() -> None:
    forecast = CompletionForecast()
    forecast.recorded(1, STREAM, 100.0)
    old_record = forecast.record_of(1)
    forecast.completed_seen(1, 100.001)
    forecast.completed_seen(1, 100.009)  # a second sighting of the same record
    assert forecast.expected(STREAM) == pytest.approx(1e-3)
    forecast.recorded(1, STREAM, 200.0)
    forecast.completed_seen(1, 200.5, old_record)  # a late callback of the older record
    assert forecast.expected(STREAM) == pytest.approx(1e-3)
    assert forecast.anticipate(1) is not None  # the newer record is still tracked


def test_short_work_gets_the_least_patience() -> None:
    forecast = CompletionForecast()
    seen(forecast, 1, 10e-6)
    forecast.recorded(1, STREAM, 1.0)
    expected = forecast.anticipate(1)
    assert expected is not None and expected.patience == LEAST_PATIENCE


def test_forgetting_events_and_streams() -> None:
    forecast = CompletionForecast()
    seen(forecast, 1, 1e-3)
    forecast.recorded(1, STREAM, 1.0)
    forecast.forget(1)
    assert forecast.anticipate(1) is None
    forecast.forget_stream(STREAM)
    assert forecast.expected(STREAM) is None
