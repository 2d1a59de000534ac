"""Forecasting when device work completes, from what was launched.

Each stream keeps a :class:`Ledger` of the work enqueued on it since the last
point seen complete: every launch with its kernel's :class:`CostModel` and
size (grid, scalars), every copy or fill with its byte count, every
device-side wait with the point it waits for. A mark (an event's record, a
stream mark) is a position in the ledger, and its forecast is a simulation
of the ledger.

Work is simulated in *bursts*: items enqueued one right after another (a
pipeline's stages and its read, eight launches in a loop) form one burst,
which starts once the work before it has ended and its first item was
enqueued, and lasts what its :class:`CostModel` predicts. A burst of one
item is predicted by its kernel's model; a burst of several by the model of
that sequence of kernels, whose features are the sums of its items' (so a
pipeline's length follows its size, eight queued kernels' the sum of their
lengths), or, until that has been seen, by the sum of its items' models. A
device-side wait ends no earlier than the forecast of the point it waits
for. So a stream's finish is the sum of its queued work, and work launched
while the device is idle starts at its launch.

Models learn from completions seen *narrowly* (a poll found the mark
pending, the next one done): a burst that started on an idle device and
ended at the mark took the measured time. A completion seen late (by a
callback, or by a poll long after the last) only brackets that time, and
moves a model only when its prediction lies outside the bracket. A model
predicts ``a + b * x`` for whichever of its features ``x`` (threads
launched, each scalar, bytes) has fitted its history best, each sample
weighted by the inverse square of its length so relative errors count
alike: a kernel whose length follows its size or a scalar is predicted
after a few completions; one that always takes as long, after one.

Sightings cost a waiter nothing: :meth:`Ledger.sighted` queues them (from
any thread: the loop's polls, the CUDA reactor's), and they are folded in on
the loop's thread the next time the ledger is used, after the waiter has
resumed. A model that already predicts within :data:`_ACCURATE` skips most
updates.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple

__all__ = [
    "LAUNCH_LATENCY",
    "Anticipation",
    "CostModel",
    "Forecast",
    "Ledger",
    "byte_features",
    "launch_features",
]

LAUNCH_LATENCY: Final = 3e-6
"""From a launch's return to the kernel starting on an idle device (2.4-2.8 µs on an H200)."""

_BURST_GAP: Final = 50e-6
"""Items enqueued within this of the one before belong to its burst."""

_MEASURED_WITHIN: Final = 30e-6
"""A completion bracketed this narrowly (or within 4% of the burst) counts as a measurement."""

_FORGET: Final = 0.95
"""Each sample's weight relative to the next one's: models follow a kernel that changes."""

_SMALLEST_COST: Final = 1e-6
"""Costs are predicted no shorter than this."""

_ACCURATE: Final = 0.015
"""A model whose prediction was this close (relatively) updates its fit only now and then."""

_REFIT_EVERY: Final = 16
"""How often an accurate model refits all the same, to follow slow drifts."""

_LOCAL_RATE: Final = 0.3
"""How far one measurement moves its quarter octave's measured point."""

_LOCAL_AT_MOST: Final = 1024
"""Measured points kept per model; more means a changed program: start again."""

_LEDGER_TRIM_AT: Final = 512
"""A ledger this long drops the items predicted to have ended long ago."""

_LEDGER_LIMIT: Final = 4096
"""A ledger never holds more; beyond it the oldest half is forgotten."""

_TRIM_PIECE: Final = 64
"""Items a trim looks at together: the ledger is dropped in pieces this long at most."""

_LEARN_FROM_AT_MOST: Final = 64
"""Longer runs of work seen complete are forgotten unlearned: learning costs as much as they."""

_FORECAST_AT_MOST: Final = 512
"""A point behind more queued items than this is not forecast (the simulation costs too much)."""

_JOIN_AT_MOST: Final = 3
"""Pieces of a split burst joined again in search of its model (a kernel never measured
would otherwise join every later burst, for nothing)."""

_WAIT_DEPTH: Final = 16
"""How many device-side waits deep a forecast follows other streams."""

Item = tuple[Any, Any, float]
"""``(model, arguments, enqueued_at)``; a device-side wait has the model ``None``."""


class Anticipation(NamedTuple):
    """When a point of a stream should complete: see :meth:`Backend.anticipate`."""

    due: float
    """The predicted completion, a :func:`time.perf_counter` instant."""
    spread: float
    """How far off such predictions have typically been, in seconds."""


def launch_features(arguments: Any) -> tuple[float, ...]:
    """The features of a launch ``(grid, block, scalar values)``: threads, then each scalar."""
    grid, block, values = arguments
    threads = grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2]
    return (float(threads), *[abs(float(value)) for value in values])


def byte_features(arguments: Any) -> tuple[float, ...]:
    """The features of a copy or fill: its byte count."""
    return (float(arguments),)


class CostModel:
    """A duration as ``a + b * x`` for the best of a vector of features ``x``, bent to fit.

    ``features`` turns what the ledger stored for a launch (or a burst) into
    the feature vector. Per feature, a weighted least-squares fit is kept as
    running sums with forgetting; the feature with the smallest residual
    predicts. With one sample, or features that never varied, the
    prediction is the mean.

    Real costs are not lines: work that fits in the L2 cache runs faster per
    byte, small grids pay a fixed tail. So where work of about that size was
    measured (a smoothed point per quarter octave of each feature), the
    prediction can interpolate between the nearest measured points instead;
    it does while that has predicted clearly better than the line.
    """

    __slots__ = (
        "_best",
        "_line_error",
        "_local",
        "_local_error",
        "_prefer_local",
        "_sums",
        "checked",
        "features",
        "name",
        "relative_error",
        "samples",
    )

    def __init__(self, name: str, features: Callable[[Any], tuple[float, ...]]) -> None:
        self.name = name
        self.features = features
        self.samples = 0
        """Samples fitted."""
        self.checked = 0
        """Predictions checked against a measurement."""
        self.relative_error = 0.25
        """A smoothed mean of ``|prediction - actual| / actual``, taken before each sample."""
        self._sums: list[list[float]] = []
        self._best: tuple[float, float, int] | None = None  # intercept, slope, feature index
        self._local: dict[tuple[int, int], tuple[float, float]] = {}
        """``(feature index, quarter octave of x)`` -> a smoothed measured ``(x, seconds)``."""
        self._line_error = 0.25
        self._local_error = 0.25
        self._prefer_local = False
        """Whether the measured points have predicted clearly better than the line lately."""

    def predict(self, arguments: Any) -> float | None:
        """The predicted duration in seconds, or ``None`` before the first sample."""
        best = self._best
        if best is None:
            return None
        intercept, slope, _ = best
        if not slope and not self._prefer_local:
            return max(intercept, _SMALLEST_COST)
        prefer_local = self._prefer_local
        line, local = self._predictions(best, self.features(arguments), local=prefer_local)
        return local if prefer_local and local is not None else line

    def _predictions(
        self, best: tuple[float, float, int], features: tuple[float, ...], *, local: bool = True
    ) -> tuple[float, float | None]:
        """The line's prediction, and the measured points' near ``x`` (if any, and ``local``)."""
        intercept, slope, index = best
        if index >= len(features):
            return max(intercept, _SMALLEST_COST), None
        x = features[index]
        line = max(intercept + slope * x, _SMALLEST_COST)
        near = self._near(index, x) if local else None
        if near is None:
            return line, None
        (x0, t0), other = near
        if other is not None and other[0] != x0:
            x1, t1 = other
            return line, max(t0 + (t1 - t0) * (x - x0) / (x1 - x0), _SMALLEST_COST)
        return line, max(t0 + slope * (x - x0), _SMALLEST_COST)

    def _near(
        self, index: int, x: float
    ) -> tuple[tuple[float, float], tuple[float, float] | None] | None:
        """The measured points nearest ``x``: its quarter octave's, and the next toward ``x``."""
        if not 0 < x < math.inf or not self._local:
            return None
        local = self._local
        step = math.floor(4 * math.log2(x))
        here = local.get((index, step))
        for distance in (1, 2):
            below = local.get((index, step - distance))
            above = local.get((index, step + distance))
            if here is None:
                if below is not None and above is not None:
                    return below, above
                here = below if below is not None else above
                if here is not None:
                    return here, None
                continue
            toward = above if x > here[0] else below
            if toward is not None:
                return here, toward
        return None if here is None else (here, None)

    def learn(self, arguments: Any, seconds: float) -> None:
        """Fold in that work with ``arguments`` took ``seconds``.

        A measurement whose features or duration are not finite is ignored.
        """
        features = self.features(arguments)
        if not math.isfinite(seconds) or not all(map(math.isfinite, features)):
            return
        best = self._best
        if best is not None:
            # The prediction as it stood (what predict() gives), then both ways scored.
            line, local = self._predictions(best, features)
            predicted = local if self._prefer_local and local is not None else line
            self._judge(line, local, seconds)
        self._remember(features, seconds)
        if best is not None:
            error = abs(predicted - seconds) / max(seconds, _SMALLEST_COST)
            self.relative_error += (min(error, 4.0) - self.relative_error) / 4
            self.checked += 1
            if error < _ACCURATE and self.samples >= 8 and self.checked % _REFIT_EVERY:
                return  # nothing new to learn; the fit costs more than the check
        if len(self._sums) != len(features):  # the first sample (or the arity changed)
            self._sums = [[0.0] * 6 for _ in features]
        weight = 1.0 / max(seconds, 10e-6) ** 2
        for sums, x in zip(self._sums, features, strict=True):
            for slot in range(6):
                sums[slot] *= _FORGET
            sums[0] += weight
            sums[1] += weight * x
            sums[2] += weight * x * x
            sums[3] += weight * seconds
            sums[4] += weight * seconds * seconds
            sums[5] += weight * x * seconds
        self.samples += 1
        self._best = self._fit()

    def _judge(self, line: float, local: float | None, seconds: float) -> None:
        """Score the line's and the measured points' predictions; prefer the better."""
        actual = max(seconds, _SMALLEST_COST)
        self._line_error += (min(abs(line - seconds) / actual, 4.0) - self._line_error) / 8
        if local is not None:
            error = min(abs(local - seconds) / actual, 4.0)
            self._local_error += (error - self._local_error) / 8
        self._prefer_local = self._local_error < 0.8 * self._line_error

    def _remember(self, features: tuple[float, ...], seconds: float) -> None:
        """Move the measured point of each feature's quarter octave toward this measurement."""
        local = self._local
        if len(local) >= _LOCAL_AT_MOST:
            local.clear()
        for index, x in enumerate(features):
            if not 0 < x < math.inf:
                continue
            key = (index, math.floor(4 * math.log2(x)))
            old = local.get(key)
            if old is None:
                local[key] = (x, seconds)
            else:
                local[key] = (
                    old[0] + (x - old[0]) * _LOCAL_RATE,
                    old[1] + (seconds - old[1]) * _LOCAL_RATE,
                )

    def confirm(self) -> None:
        """A prediction was seen to be right, as closely as could be told: trust it more."""
        self.relative_error *= 0.75

    def _fit(self) -> tuple[float, float, int]:
        best: tuple[float, float, int] | None = None
        best_residual = math.inf
        for index, (s0, s1, s2, t1, t2, c) in enumerate(self._sums):
            mean_x, mean_y = s1 / s0, t1 / s0
            var_x = s2 / s0 - mean_x * mean_x
            var_y = max(t2 / s0 - mean_y * mean_y, 0.0)
            if self.samples < 2 or var_x <= 1e-9 * (mean_x * mean_x + 1e-30):
                fit, residual = (mean_y, 0.0, index), var_y
            else:
                slope = (c / s0 - mean_x * mean_y) / var_x
                fit = (mean_y - slope * mean_x, slope, index)
                residual = max(var_y - slope * slope * var_x, 0.0)
            if residual < best_residual * (1 - 1e-9):
                best, best_residual = fit, residual
        assert best is not None
        return best

    def __repr__(self) -> str:
        return f"<CostModel {self.name}: {self.samples} samples, fit {self._best}>"


def _burst_features(burst: Sequence[Item]) -> tuple[float, ...]:
    """A burst's features: per kernel of the burst (in order), the sums of its items' features."""
    sums: dict[int, list[float]] = {}
    for model, arguments, _ in burst:
        features = model.features(arguments)
        total = sums.get(id(model))
        if total is None:
            sums[id(model)] = list(features)
        else:
            for index, value in enumerate(features):
                total[index] += value
    return tuple(value for total in sums.values() for value in total)


class Forecast:
    """A backend's cost models: per kernel image, per kind of copy, per burst's sequence.

    A kernel image's model is shared by every load of it.
    """

    __slots__ = ("_bursts", "_models")

    def __init__(self) -> None:
        self._models: dict[Any, CostModel] = {}
        self._bursts: dict[tuple[CostModel, ...], CostModel] = {}

    def model(
        self, key: Any, name: str, features: Callable[[Any], tuple[float, ...]] = launch_features
    ) -> CostModel:
        """The model for ``key`` (made on first use)."""
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = CostModel(name, features)
        return model

    def _model_of(self, burst: Sequence[Item]) -> tuple[CostModel | None, Any]:
        """The model that sizes ``burst`` and what it takes: its one item's, or its sequence's."""
        if len(burst) == 1:
            model, arguments, _ = burst[0]
            return model, arguments
        return self._bursts.get(tuple(item[0] for item in burst)), burst

    def _new_burst_model(self, burst: Sequence[Item]) -> CostModel:
        key = tuple(model for model, _, _ in burst)
        if len(self._bursts) >= 4096:  # a program of endlessly new sequences
            self._bursts.clear()
        model = self._bursts[key] = CostModel("+".join(each.name for each in key), _burst_features)
        return model

    def predict(self, burst: Sequence[Item]) -> tuple[float, float] | None:
        """A burst's duration from its first item's start, and its spread, if its model knows."""
        model, arguments = self._model_of(burst)
        if model is None:
            return None
        cost = model.predict(arguments)
        return None if cost is None else (cost, model.relative_error * cost)

    def finish(self, burst: Sequence[Item], end: float) -> tuple[float, float] | None:
        """When a burst ends if the work before it ends at ``end``, and the spread of that.

        A sequence of kernels never measured as a burst is simulated item by
        item from its kernels' models. ``None`` if one of them was never measured.
        """
        predicted = self.predict(burst)
        if predicted is not None:
            return max(end, burst[0][2] + LAUNCH_LATENCY) + predicted[0], predicted[1]
        spread = 0.0
        for model, arguments, enqueued_at in burst:
            cost = model.predict(arguments)
            if cost is None:
                return None
            end = max(end, enqueued_at + LAUNCH_LATENCY) + cost
            spread += max(model.relative_error, 0.25) * cost
        return end, spread

    def confirm(self, burst: Sequence[Item]) -> None:
        """A burst ended where its model said it would, as far as a sighting could tell."""
        model, _ = self._model_of(burst)
        if model is not None:
            model.confirm()

    def learn(self, burst: Sequence[Item], seconds: float) -> None:
        """A burst took ``seconds`` (measured)."""
        model, arguments = self._model_of(burst)
        if model is None:
            model = self._new_burst_model(burst)
        model.learn(arguments, seconds)

    def models(self) -> list[CostModel]:
        """Every model, for diagnostics."""
        return [*self._models.values(), *self._bursts.values()]


class _Wait(NamedTuple):
    """A device-side wait in a ledger: the stream waits for ``position`` of ``ledger``."""

    ledger: Ledger
    position: int


class Ledger:
    """The work enqueued on one stream since the last point seen complete.

    Positions count items from the stream's creation: a mark at position
    ``p`` completes when the first ``p`` items have.
    """

    __slots__ = ("first", "forecast", "items", "sightings", "start", "start_known")

    def __init__(self, forecast: Forecast) -> None:
        self.forecast = forecast
        self.items: list[Item] = []
        self.first = 0
        """The position of ``items[0]``."""
        self.start = 0.0
        """The earliest ``items[0]`` can have started: when the work before it ended."""
        self.start_known = True
        """Whether ``start`` was measured (or the stream was idle, as a new one is)."""
        self.sightings: deque[tuple[int, float | None, float]] = deque()

    # ----- the launch path (hot) -----------------------------------------------------------

    def enqueue(self, model: CostModel, arguments: Any) -> None:
        """Note a launch (or copy, fill) just enqueued; ``model.features(arguments)`` sizes it."""
        if self.sightings:
            self._fold_sightings()
        items = self.items
        items.append((model, arguments, time.perf_counter()))
        length = len(items)
        if length >= _LEDGER_TRIM_AT and not length % 256:
            self._trim()

    def lose_track(self) -> None:
        """The stream now waits for work the ledger cannot see: forecast nothing queued so far.

        What is enqueued from here on starts when that unseen work ends, which
        is not known, so forecasts resume once a later point is seen complete.
        """
        self.enqueue_wait(_UNKNOWABLE, 1)

    def enqueue_wait(self, ledger: Ledger, position: int) -> None:
        """Note a device-side wait for ``position`` of another stream's ``ledger``."""
        self.items.append((None, _Wait(ledger, position), time.perf_counter()))

    @property
    def position(self) -> int:
        """The position after everything enqueued so far: where a mark made now sits."""
        return self.first + len(self.items)

    def sighted(self, position: int, pending_at: float | None, seen_at: float) -> None:
        """The first ``position`` items were seen complete at ``seen_at``; from any thread.

        ``pending_at`` is when the same point was last seen pending, if it
        was. Only queued (a deque append): :meth:`completed` runs on the
        loop's thread the next time the ledger is used.
        """
        self.sightings.append((position, pending_at, seen_at))

    # ----- forecasts -----------------------------------------------------------------------

    def anticipate(self, position: int, depth: int = 0) -> Anticipation | None:
        """When the first ``position`` items should have completed; ``None`` if unknown."""
        if self.sightings:
            self._fold_sightings()
        return self._simulate(position, depth)

    def _simulate(self, position: int, depth: int) -> Anticipation | None:
        count = position - self.first
        if count <= 0:
            return Anticipation(self.start, 0.0)
        if count > _FORECAST_AT_MOST:
            return None
        return self._simulate_bursts(_bursts(self.items[:count]), depth)

    def _simulate_bursts(self, bursts: list[list[Item]], depth: int) -> Anticipation | None:
        """When ``bursts`` (the ledger's first items, grouped) end, run from ``start``."""
        end, spread = self.start, 0.0
        index = 0
        while index < len(bursts):
            burst = bursts[index]
            index += 1
            model, arguments, _ = burst[0]
            if model is None:
                if depth >= _WAIT_DEPTH:
                    return None
                awaited = arguments.ledger.anticipate(arguments.position, depth + 1)
                if awaited is None:
                    return None
                if awaited.due > end:
                    end, spread = awaited.due, max(spread, awaited.spread)
                continue
            finished = self.forecast.finish(burst, end)
            joined = 0
            while (
                finished is None
                and joined < _JOIN_AT_MOST
                and index < len(bursts)
                and bursts[index][0][0] is not None
            ):
                # A pause on the host (a collection, a first allocation) split a burst it has
                # measured whole: join the pieces again.
                burst = burst + bursts[index]
                index += 1
                joined += 1
                finished = self.forecast.finish(burst, end)
            if finished is None:
                return None
            end, spread = finished[0], spread + finished[1]
        return Anticipation(end, spread)

    # ----- what was seen -------------------------------------------------------------------

    def completed(self, position: int, pending_at: float | None, seen_at: float) -> None:
        """The first ``position`` items were seen complete at ``seen_at`` (see :meth:`sighted`).

        Learns from the burst that ended there, then forgets the items. Call
        it on the loop's thread, with the sightings queued before it folded.
        """
        count = position - self.first
        if count <= 0:
            return
        narrow = False
        if count <= _LEARN_FROM_AT_MOST:
            narrow = self._learn_from(count, pending_at, seen_at)
        del self.items[:count]
        self.first = position
        if narrow:
            assert pending_at is not None
            self.start, self.start_known = (pending_at + seen_at) / 2, True
        else:
            self.start, self.start_known = seen_at, not self.items

    def _learn_from(self, count: int, pending_at: float | None, seen_at: float) -> bool:
        """Learn from the burst that ended the first ``count`` items; whether it was measured."""
        bursts = _bursts(self.items[:count])
        last = bursts[-1]
        narrow = False
        if last[0][0] is not None:
            begin = self._begin_of(bursts)
            if begin is not None:
                narrow = pending_at is not None and seen_at - pending_at <= max(
                    _MEASURED_WITHIN, 0.04 * (seen_at - begin)
                )
                lower = 0.0 if pending_at is None else pending_at - begin
                self._learn(last, lower, seen_at - begin, narrow)
        return narrow

    def _begin_of(self, bursts: list[list[Item]]) -> float | None:
        """When the last burst began, if the device was idle for it (as the models see it)."""
        first_of_last = bursts[-1][0][2] + LAUNCH_LATENCY
        if len(bursts) == 1:
            return max(first_of_last, self.start) if self.start_known else None
        before = self._simulate_bursts(bursts[:-1], 0)
        if before is not None and before.due <= first_of_last:
            return first_of_last
        return None

    def _learn(self, burst: list[Item], lower: float, upper: float, narrow: bool) -> None:
        forecast = self.forecast
        if narrow:
            forecast.learn(burst, (lower + upper) / 2)
            return
        # Seen too coarsely to measure: move a model only if it predicts outside the bracket;
        # inside it, the prediction stands (and counts as a right one).
        finished = forecast.finish(burst, 0.0)
        target = (lower + upper) / 2 if lower > 0 else upper
        if finished is None or not lower <= finished[0] - burst[0][2] - LAUNCH_LATENCY <= upper:
            forecast.learn(burst, target)
        else:
            forecast.confirm(burst)

    def _fold_sightings(self) -> None:
        sightings = self.sightings
        while sightings:
            position, pending_at, seen_at = sightings.popleft()
            if position > self.first:
                self.completed(position, pending_at, seen_at)

    def _trim(self) -> None:
        """Drop what is predicted to have ended over a millisecond ago (or the oldest half)."""
        now = time.perf_counter()
        end = self.start
        keep_from = 0
        # In pieces, looked at lazily: a stream fed without pause is one long burst, and
        # the scan stops at the first piece not yet over (O(what is dropped), not O(ledger)).
        for burst in _iter_bursts(self.items, _TRIM_PIECE):
            finished = None if burst[0][0] is None else self.forecast.finish(burst, end)
            if finished is None:
                break
            end = finished[0]
            if end >= now - 1e-3:
                break
            keep_from += len(burst)
        if keep_from == 0 and len(self.items) >= _LEDGER_LIMIT:
            keep_from, end = len(self.items) // 2, now
        if keep_from:
            del self.items[:keep_from]
            self.first += keep_from
            self.start, self.start_known = end, False


class _Unseen(Ledger):
    """Work on a stream nobody here can see (another library's): never forecast."""

    __slots__ = ()

    def anticipate(self, position: int, depth: int = 0) -> Anticipation | None:
        return None


_UNKNOWABLE: Final = _Unseen(Forecast())


def _bursts(items: Sequence[Item]) -> list[list[Item]]:
    """Group items enqueued right after one another; each device-side wait stands alone."""
    return list(_iter_bursts(items))


def _iter_bursts(items: Sequence[Item], longest: float = math.inf) -> Iterator[list[Item]]:
    """:func:`_bursts` one at a time, each cut after ``longest`` items."""
    current: list[Item] = []
    last_enqueued = -math.inf
    for item in items:
        model, _, enqueued_at = item
        if model is None:
            if current:
                yield current
                current = []
            yield [item]
            last_enqueued = -math.inf
            continue
        if current and (enqueued_at - last_enqueued > _BURST_GAP or len(current) >= longest):
            yield current
            current = []
        current.append(item)
        last_enqueued = enqueued_at
    if current:
        yield current
