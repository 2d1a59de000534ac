"""The completion forecast: cost models learned from what was launched, ledgers simulated."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from accy_async.backends import forecast as forecast_module
from accy_async.backends.forecast import (
    LAUNCH_LATENCY,
    MEASUREMENT_BLUR,
    CostModel,
    Forecast,
    Ledger,
    byte_features,
    launch_features,
)


class Clock:
    """Stands in for ``time.perf_counter`` inside the forecast module."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(forecast_module, "time", fake)
    return fake


def launch(ns: float, blocks: int = 1) -> tuple[Any, ...]:
    return ((blocks, 1, 1), (256, 1, 1), (ns,))


def seen_at(ledger: Ledger, position: int, end: float, width: float = 10e-6) -> None:
    """``position`` seen done after ``end``, by a poll ``width`` after one seeing it pending."""
    ledger.completed(position, end - width / 2, end + width / 2)


def test_nothing_is_forecast_before_the_kernel_was_seen_once(clock: Clock) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    assert ledger.anticipate(ledger.position) is None
    assert ledger.anticipate(0) == (ledger.start, 0.0)  # nothing before position 0


def test_a_kernel_of_constant_length_is_predicted_after_one_measurement(clock: Clock) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 1e-3)
    clock.now = 200.0
    ledger.enqueue(model, launch(1))
    expected = ledger.anticipate(ledger.position)
    assert expected is not None
    assert expected.due == pytest.approx(200.0 + LAUNCH_LATENCY + 1e-3, abs=1e-7)


def test_a_length_set_by_a_scalar_is_learned_as_a_line(clock: Clock) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("spin", "spin")
    rng = random.Random(1)
    for _ in range(12):
        clock.now += 1.0
        ns = 10 ** rng.uniform(4.7, 6.7)  # 50 us .. 5 ms
        ledger.enqueue(model, launch(ns))
        seen_at(ledger, ledger.position, clock.now + LAUNCH_LATENCY + 2e-6 + ns * 1e-9)
    for ns in (60e3, 700e3, 4.5e6):
        clock.now += 1.0
        ledger.enqueue(model, launch(ns))
        expected = ledger.anticipate(ledger.position)
        assert expected is not None
        true_end = clock.now + LAUNCH_LATENCY + 2e-6 + ns * 1e-9
        assert expected.due == pytest.approx(true_end, abs=0.01 * ns * 1e-9 + 1e-6)
        seen_at(ledger, ledger.position, true_end)
    assert model.relative_error < 0.05


def test_the_best_feature_wins_grid_or_scalar(clock: Clock) -> None:
    """A kernel whose length follows its grid (the scalar is noise) is predicted from the grid."""
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("scan", "scan")
    rng = random.Random(2)
    for _ in range(16):
        clock.now += 1.0
        blocks = rng.randint(1, 100_000)
        ledger.enqueue(model, ((blocks, 1, 1), (1024, 1, 1), (rng.randint(0, 10**6),)))
        seen_at(ledger, ledger.position, clock.now + LAUNCH_LATENCY + 5e-6 + blocks * 20e-9)
    clock.now += 1.0
    ledger.enqueue(model, ((50_000, 1, 1), (1024, 1, 1), (7,)))
    expected = ledger.anticipate(ledger.position)
    assert expected is not None
    assert expected.due - clock.now == pytest.approx(LAUNCH_LATENCY + 5e-6 + 1e-3, rel=0.01)


def test_work_queued_on_a_stream_is_summed(clock: Clock) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 1e-3)
    clock.now = 200.0
    for _ in range(8):
        ledger.enqueue(model, launch(1))
        clock.now += 1e-6  # launched back to back
    expected = ledger.anticipate(ledger.position)
    assert expected is not None
    assert expected.due == pytest.approx(200.0 + LAUNCH_LATENCY + 8e-3, abs=1e-7)
    middle = ledger.anticipate(ledger.first + 4)
    assert middle is not None
    assert middle.due == pytest.approx(200.0 + LAUNCH_LATENCY + 4e-3, abs=1e-7)


def test_launches_slower_than_the_kernels_end_with_the_last_launch(clock: Clock) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("tiny", "tiny")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 2e-6, width=1e-6)
    clock.now = 200.0
    for _ in range(3):
        ledger.enqueue(model, launch(1))
        clock.now += 10e-6  # the host launches every 10 us; each kernel takes 2 us
    expected = ledger.anticipate(ledger.position)
    assert expected is not None
    assert expected.due == pytest.approx(200.0 + 20e-6 + LAUNCH_LATENCY + 2e-6, abs=1e-7)


class ScanRequests:
    """Three stages and a copy launched in a burst on one ledger, measured only as a whole."""

    costs = (
        lambda n: 3e-6 + n * 4e-9,
        lambda n: 4e-6,
        lambda n: 3e-6 + n * 4e-9,
    )

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        forecast = Forecast()
        self.stages = [forecast.model(name, name) for name in ("a", "b", "c")]
        self.copy = forecast.model("dtoh", "dtoh", byte_features)
        self.ledger = Ledger(forecast)
        self.end = clock.now

    def request(self, n: int, pause_before_last_stage: float = 0.0) -> float:
        """Enqueue one request of size n, 0.1 s after the last one ended; return its true end."""
        clock = self.clock
        clock.now = self.end + 0.1
        start = clock.now
        for index, stage in enumerate(self.stages):
            if index == len(self.stages) - 1:
                clock.now += pause_before_last_stage
            self.ledger.enqueue(stage, ((n // 1024 + 1, 1, 1), (1024, 1, 1), (n,)))
            clock.now += 2e-6
        self.ledger.enqueue(self.copy, 4)
        clock.now += 2e-6
        end = start + LAUNCH_LATENCY + sum(cost(n) for cost in self.costs) + 3e-6
        self.end = max(end, clock.now + LAUNCH_LATENCY + 3e-6)
        return self.end

    def train(self, count: int) -> None:
        rng = random.Random(3)
        for _ in range(count):
            end = self.request(int(10 ** rng.uniform(5, 8.5)))
            seen_at(self.ledger, self.ledger.position, end)


def test_a_pipeline_teaches_each_stage_its_share(clock: Clock) -> None:
    requests = ScanRequests(clock)
    requests.train(40)
    for n in (200_000, 30_000_000, 250_000_000):
        true_end = requests.request(n)
        expected = requests.ledger.anticipate(requests.ledger.position)
        assert expected is not None
        assert expected.due == pytest.approx(true_end, abs=0.02 * (true_end - clock.now) + 2e-6)
        seen_at(requests.ledger, requests.ledger.position, true_end)


def test_a_burst_split_by_a_pause_on_the_host_is_still_forecast(clock: Clock) -> None:
    """A collection between two launches splits the burst into pieces never measured alone."""
    requests = ScanRequests(clock)
    requests.train(40)
    requests.request(30_000_000, pause_before_last_stage=200e-6)
    expected = requests.ledger.anticipate(requests.ledger.position)
    assert expected is not None
    whole = sum(cost(30_000_000) for cost in ScanRequests.costs)
    assert expected.due >= requests.end - 200e-6 - 0.02 * whole


def test_a_device_side_wait_follows_the_other_stream(clock: Clock) -> None:
    forecast = Forecast()
    producer, consumer = Ledger(forecast), Ledger(forecast)
    model = forecast.model("k", "k")
    producer.enqueue(model, launch(1))
    seen_at(producer, 1, clock.now + LAUNCH_LATENCY + 1e-3)
    clock.now = 200.0
    producer.enqueue(model, launch(1))
    point = producer.position
    consumer.enqueue_wait(producer, point)
    consumer.enqueue(model, launch(1))
    expected = consumer.anticipate(consumer.position)
    assert expected is not None
    assert expected.due == pytest.approx(200.0 + LAUNCH_LATENCY + 2e-3, abs=1e-7)


def test_a_run_behind_a_wait_teaches_nothing(clock: Clock) -> None:
    forecast = Forecast()
    producer, consumer = Ledger(forecast), Ledger(forecast)
    model = forecast.model("k", "k")
    producer.enqueue(model, launch(1))
    consumer.enqueue_wait(producer, producer.position)
    consumer.enqueue(model, launch(1))
    seen_at(consumer, consumer.position, clock.now + 5e-3)
    assert model.samples == 0
    assert consumer.items == []  # forgotten all the same


def test_a_late_sighting_only_bounds(clock: Clock) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 1e-3)
    samples = model.samples
    clock.now = 200.0
    ledger.enqueue(model, launch(1))
    ledger.completed(ledger.position, None, clock.now + 2e-3)  # done by 2 ms: no news
    assert model.samples == samples
    clock.now = 300.0
    ledger.enqueue(model, launch(1))
    ledger.sighted(ledger.position, 300.0002, 300.0006)  # from the reactor's thread: shorter
    clock.now = 400.0
    ledger.enqueue(model, launch(1))
    expected = ledger.anticipate(ledger.position)  # folds the sighting in first
    assert expected is not None
    assert model.samples == samples + 1
    assert expected.due - 400.0 < 1e-3


def test_a_coarse_sighting_makes_a_model_no_surer_than_its_bracket(clock: Clock) -> None:
    """A wait that looks once, long after the due time, confirms nothing (a model that runs
    long would otherwise grow sure of itself); a bracket within the spread does."""
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 2e-3)  # measured: 2 ms
    sure = model.relative_error
    for _ in range(20):  # pending when the wait began, seen done 0.5 ms past the due time
        clock.now += 1.0
        ledger.enqueue(model, launch(1))
        ledger.completed(ledger.position, clock.now, clock.now + LAUNCH_LATENCY + 2.5e-3)
    assert model.relative_error == sure
    clock.now += 1.0
    ledger.enqueue(model, launch(1))
    begin = clock.now + LAUNCH_LATENCY
    ledger.completed(ledger.position, begin + 1.9e-3, begin + 2.1e-3)  # within its spread
    assert model.relative_error < sure


def test_a_long_ledger_forgets_what_must_have_ended(clock: Clock) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 1e-6, width=1e-6)
    for _ in range(600):  # nobody waits on this stream
        ledger.enqueue(model, launch(1))
        clock.now += 1e-3
    assert len(ledger.items) < 600
    assert ledger.position == 601
    assert not ledger.start_known


def test_a_stream_fed_without_pause_is_trimmed_in_pieces(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One endless burst: trims look at a piece past what they drop, not the whole ledger."""
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 1e-6, width=1e-6)
    looked: list[int] = []
    finish = Forecast.finish

    def counted(self: Forecast, burst: Any, end: float) -> tuple[float, float] | None:
        looked.append(len(burst))
        return finish(self, burst, end)

    monkeypatch.setattr(Forecast, "finish", counted)
    for _ in range(5000):  # 10 us apart: a single burst, never waited for
        ledger.enqueue(model, launch(1))
        clock.now += 10e-6
    assert len(ledger.items) <= 1024  # trimmed as it went, never grown to the limit
    assert max(looked) <= 64
    assert sum(looked) < 2 * 5000  # each item looked at about once


def test_models_are_shared_per_key() -> None:
    forecast = Forecast()
    assert forecast.model("k", "k") is forecast.model("k", "other name")
    assert forecast.model("j", "j") is not forecast.model("k", "k")
    assert len(forecast.models()) == 2


def test_thousands_of_queued_sightings_fold_in_one_go(clock: Clock) -> None:
    """A stream nobody polls from the loop (every wait a callback): sightings pile up."""
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    for _ in range(5000):
        ledger.sighted(1, None, clock.now + 1e-3)  # the same point, seen again and again
    ledger.enqueue(model, launch(1))  # folds them all, iteratively
    assert not ledger.sightings
    assert ledger.first == 1


def test_a_sighting_narrow_for_its_burst_teaches_with_a_newer_one_behind_it(
    clock: Clock,
) -> None:
    """Narrow is judged as the learner judges it (within 4% of a long burst), not 30 us."""
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    end = clock.now + LAUNCH_LATENCY + 2e-3
    ledger.sighted(1, end - 25e-6, end + 25e-6)  # a 2 ms kernel, bracketed within 50 us
    clock.now = end + 1e-3
    ledger.enqueue(model, launch(1))
    ledger.sighted(2, None, clock.now + 3e-3)  # coarse, and newer
    ledger.anticipate(ledger.position)
    predicted = model.predict(launch(1))
    assert predicted is not None and predicted == pytest.approx(2e-3, rel=0.05)  # A's lesson


def test_an_accurate_model_refits_only_now_and_then() -> None:
    model = CostModel("k", launch_features)
    for _ in range(40):
        model.learn(launch(1), 1e-3)
    assert model.checked == 39
    assert 8 <= model.samples < 15  # refits stop once it predicts within 1.5%
    assert model.relative_error < 0.01
    fitted = model.samples
    model.learn(launch(1), 2e-3)  # the kernel changed: a sample that surprises is fitted
    assert model.samples == fitted + 1


def test_a_model_forgets_old_samples_across_thousands_of_them() -> None:
    """Past the weights' rescaling (about 4,500 samples), the fit still follows a change."""
    model = CostModel("copy", byte_features)
    rng = random.Random(7)
    for _ in range(6000):
        n = 10 ** rng.uniform(4, 8)
        model.learn(n, (10e-6 + n * 1e-12) * (1 + 0.05 * rng.uniform(-1, 1)))
    predicted = model.predict(1e7)
    assert predicted is not None and predicted == pytest.approx(20e-6, rel=0.05)
    for _ in range(300):  # the copies become twice as slow per byte
        n = 10 ** rng.uniform(4, 8)
        model.learn(n, (10e-6 + n * 2e-12) * (1 + 0.05 * rng.uniform(-1, 1)))
    predicted = model.predict(1e7)
    assert predicted is not None and predicted == pytest.approx(30e-6, rel=0.05)


def test_a_settled_model_keeps_measured_points_of_its_predicting_feature_only() -> None:
    """After its first 32 samples, a model of three features updates one feature's points."""
    model = CostModel("k", launch_features)
    rng = random.Random(3)

    def learn_one() -> None:
        n = int(10 ** rng.uniform(3, 6))
        noisy = (5e-6 + n * 1e-9) * rng.uniform(0.8, 1.2)
        model.learn(((n // 256 + 1, 1, 1), (256, 1, 1), (n, 7)), noisy)

    while model.samples < 32:
        learn_one()
    assert {feature for feature, _ in model._local} == {0, 1, 2}  # threads, n, the constant 7
    for _ in range(64):
        before, best, fitted = dict(model._local), model._best, model.samples
        assert best is not None
        learn_one()
        moved = {key for key, point in model._local.items() if before.get(key) != point}
        if model.samples > fitted:  # not one of the few within 1.5% (those move nothing)
            assert moved and {feature for feature, _ in moved} == {best[2]}  # the predicting one
        else:
            assert not moved


def test_a_bracketed_completion_counts_the_prediction_off_by_its_distance_to_the_bracket() -> None:
    """Seen only within [0.2, 0.8] ms, a 1 ms prediction is 0.2 ms off, not 0.5 (the middle)."""
    model = CostModel("k", launch_features)
    for _ in range(20):
        model.learn(launch(1), 1e-3)
    assert model.relative_error < 0.01
    before = model.relative_error
    model.learn(launch(1), 0.5e-3, (0.2e-3, 0.8e-3))
    off = 0.2e-3 / (0.8e-3 + MEASUREMENT_BLUR)
    assert model.relative_error == pytest.approx(before + (off - before) / 4)


def test_short_kernels_blurred_by_polls_leave_a_long_kernels_forecast_sure() -> None:
    """Lengths 50 us-5 ms, each seen up to 25 us off: a long kernel's spread stays a few percent.

    A wait sleeps on a forecast only when its spread is under a quarter of the time to go.
    """
    forecast = Forecast()
    model = forecast.model("spin", "spin")
    rng = random.Random(4)
    widest = 0.0
    for index in range(400):
        length = math.exp(rng.uniform(math.log(50e-6), math.log(5e-3)))
        arguments = ((1, 1, 1), (1, 1, 1), (int(length * 1e9),))
        if index > 50 and length > 2e-3:
            predicted = forecast.predict([(model, arguments, 0.0)])
            assert predicted is not None
            widest = max(widest, predicted[1] / predicted[0])
        model.learn(arguments, length + rng.uniform(-25e-6, 25e-6))
    assert 0 < widest < 0.16  # 0.23 when errors were taken over the bare duration
    short = forecast.predict([(model, ((1, 1, 1), (1, 1, 1), (50_000,)), 0.0)])
    assert short is not None and short[1] >= model.relative_error * MEASUREMENT_BLUR


def test_a_cost_that_is_not_a_line_is_learned_per_size() -> None:
    """A scan whose work fits in the L2 cache below 6e6 elements runs 2.5x faster per element."""

    def cost(n: float) -> float:
        in_cache = min(n, 6e6)
        return 4e-6 + in_cache * 0.4e-12 * 1e3 / 2.5 + max(n - 6e6, 0) * 0.4e-12 * 1e3

    model = CostModel("scan", byte_features)
    rng = random.Random(5)
    for _ in range(300):
        n = 10 ** rng.uniform(5, 8.5)
        model.learn(n, cost(n))
    errors = []
    for _ in range(200):
        n = 10 ** rng.uniform(5, 8.5)
        predicted = model.predict(n)
        assert predicted is not None
        errors.append(abs(predicted - cost(n)) / cost(n))
    errors.sort()
    assert errors[len(errors) // 2] < 0.01, errors[len(errors) // 2]
    assert errors[int(0.9 * len(errors))] < 0.03, errors[int(0.9 * len(errors))]
    assert model.relative_error < 0.03


def test_features_that_are_not_finite_are_not_located() -> None:
    """A feature of inf or nan has no size octave: it is skipped, never raised on."""
    model = CostModel("k", byte_features)
    model.learn(1000.0, 1e-3)
    for odd in (math.inf, math.nan):
        model.learn(odd, 1e-3)
        model.predict(odd)


def test_a_wait_for_unseen_work_stops_forecasts_until_a_later_point_is_seen(
    clock: Clock,
) -> None:
    """A stream made to wait for another library's stream: its work starts when that ends."""
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    ledger.enqueue(model, launch(1))
    seen_at(ledger, 1, clock.now + LAUNCH_LATENCY + 1e-3)
    clock.now += 1.0
    ledger.lose_track()
    ledger.enqueue(model, launch(1))
    assert ledger.anticipate(ledger.position) is None
    seen_at(ledger, ledger.position, clock.now + 5e-3)
    clock.now += 1.0
    ledger.enqueue(model, launch(1))
    expected = ledger.anticipate(ledger.position)
    assert expected is not None
    assert expected.due == pytest.approx(clock.now + LAUNCH_LATENCY + 1e-3, abs=1e-6)


def test_a_settled_model_learns_from_at_most_one_completion_a_millisecond(clock: Clock) -> None:
    """Thousands of small requests a second would cost more CPU to learn from than they run."""
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    rng = random.Random(3)

    def one(gap: float) -> None:
        clock.now += gap
        ns = 10 ** rng.uniform(4, 5)
        ledger.enqueue(model, launch(ns))
        seen_at(ledger, ledger.position, clock.now + LAUNCH_LATENCY + ns * 1e-9)

    for _ in range(40):  # young, then settled: each completion 10 ms apart is learned
        one(10e-3)
    assert model.checked == 39  # every one after the first checked the prediction
    for _ in range(100):  # 100 completions in 20 ms: about one a millisecond is learned
        one(200e-6)
    assert 16 <= model.checked - 39 <= 21
    assert ledger.items == []  # every completion still ends its items
    lessons = model.checked
    one(10e-3)
    assert model.checked == lessons + 1
    expected = ledger.forecast.predict([(model, launch(50e3), 0.0)])
    assert expected is not None
    assert expected[0] == pytest.approx(50e-6, rel=0.05)  # it still predicts


def test_a_young_model_learns_from_every_completion_and_a_coarse_one_spends_no_lesson(
    clock: Clock,
) -> None:
    ledger = Ledger(Forecast())
    model = ledger.forecast.model("k", "k")
    for _ in range(40):  # 200 us apart: the first 32 checked, then one a millisecond
        clock.now += 200e-6
        ledger.enqueue(model, launch(50e3))
        seen_at(ledger, ledger.position, clock.now + LAUNCH_LATENCY + 50e-6)
    assert 32 <= model.checked <= 34
    clock.now += 10e-3
    ledger.enqueue(model, launch(50e3))
    ledger.completed(ledger.position, None, clock.now + 5e-3)  # done by 5 ms: moves nothing
    checked = model.checked
    clock.now += 100e-6  # within the millisecond: the narrow sighting still teaches
    ledger.enqueue(model, launch(50e3))
    seen_at(ledger, ledger.position, clock.now + LAUNCH_LATENCY + 50e-6)
    assert model.checked == checked + 1
