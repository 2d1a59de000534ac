"""The forecast's cost models: how long a kernel, a copy or a burst of them takes.

A :class:`CostModel` predicts ``a + b * x`` for whichever of its features ``x``
(threads launched, each scalar, bytes) has fitted its history best, each
sample weighted by the inverse square of its length so relative errors count
alike, and interpolates between measured points where that has predicted
better. A :class:`Forecast` holds a backend's models: per kernel image, per
kind of copy, per sequence of kernels seen as one burst. The ledgers that
decide what to predict and when a completion measured something live in
:mod:`.forecast`, which re-exports these names.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "LAUNCH_LATENCY",
    "LESSON_INTERVAL",
    "MEASUREMENT_BLUR",
    "CostModel",
    "Forecast",
    "Item",
    "byte_features",
    "launch_features",
]

MEASUREMENT_BLUR: Final = 30e-6
"""How narrowly a completion seen by polls counts as measuring a duration (a bracket this
narrow, or within 4% of the burst, is a measurement).

Errors are taken relative to the duration plus this, and spreads predicted
as that fraction of the cost plus this: a 50 µs kernel seen 15 µs off is
blurred by the polls, not 30% unpredictable, and must not make a 4 ms
kernel's forecast of the same model look a millisecond unsure."""

LAUNCH_LATENCY: Final = 3e-6
"""From a launch's return to the kernel starting on an idle device (2.4-2.8 µs on an H200)."""

_FORGET: Final = 0.95
"""Each sample's weight relative to the next one's: models follow a kernel that changes."""

_RESCALE_AT: Final = 1e100
"""A weight factor this large scales the sums back down (after about 4,500 samples)."""

_SMALLEST_COST: Final = 1e-6
"""Costs are predicted no shorter than this."""

_ACCURATE: Final = 0.015
"""A model whose prediction was this close (relatively) updates its fit only now and then."""

_REFIT_EVERY: Final = 16
"""How often an accurate model refits all the same, to follow slow drifts."""

_LOCAL_RATE: Final = 0.3
"""How far one measurement moves its quarter octave's measured point."""

_REMEMBER_EVERY_FEATURE_UNTIL: Final = 32
"""Samples for which every feature's measured points are kept; after them, the best one's."""

_LOCAL_AT_MOST: Final = 1024
"""Measured points kept per model; more means a changed program: start again."""

LESSON_INTERVAL: Final = 1e-3
"""A model past its first :data:`_LEARN_FREELY_UNTIL` checked predictions moves for at most
one completion in this long, counted over every stream that shares it (see
:meth:`CostModel.takes_lesson`).

Learning from a completion costs tens of microseconds of CPU on a slow host (the fit, its
scores, the measured points), more than the work it learns from when requests come
thousands a second: this bounds it to a few percent of a core per model, however fast the
completions come. A model whose completions come a millisecond or more apart moves for
each, as before; a settled model whose kernel changes cost follows at one lesson a
millisecond."""

_LEARN_FREELY_UNTIL: Final = 32
"""Checked predictions (:attr:`CostModel.checked`) a model learns from however close together
they come (a young model)."""

Item = tuple[Any, Any, float]
"""``(model, arguments, enqueued_at)``; a device-side wait has the model ``None``."""


def launch_features(arguments: Any) -> tuple[float, ...]:
    """The features of a launch ``(grid, block, scalar values)``: threads, then each scalar."""
    grid, block, values = arguments
    threads = grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2]
    return (float(threads), *map(abs, map(float, values)))


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
        "_scale",
        "_sums",
        "checked",
        "features",
        "name",
        "next_lesson",
        "relative_error",
        "samples",
    )

    def __init__(self, name: str, features: Callable[[Any], tuple[float, ...]]) -> None:
        self.name = name
        self.features = features
        self.samples = 0
        """Samples fitted."""
        self.next_lesson = 0.0
        """When the next completion may be learned from (see :data:`LESSON_INTERVAL`)."""
        self.checked = 0
        """Predictions checked against a measurement."""
        self.relative_error = 0.25
        """A smoothed mean of ``|prediction - actual| / (actual + MEASUREMENT_BLUR)``, taken
        before each sample (for a bracketed one, the prediction's distance to the bracket)."""
        self._sums: list[list[float]] = []
        """Per feature, the weighted sums of 1, x, x², t, t² and x·t (see :meth:`learn`)."""
        self._scale = 1.0
        """The latest sample's weight factor; it grows by ``1 / _FORGET`` a sample."""
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

    def spread(self, cost: float, least_error: float = 0.0) -> float:
        """How far off a prediction of ``cost`` seconds typically is, in seconds.

        ``least_error``: the relative error to assume at least (for a model
        standing in for a sequence it never measured).
        """
        return max(self.relative_error, least_error) * (cost + MEASUREMENT_BLUR)

    def learn(
        self, arguments: Any, seconds: float, bracket: tuple[float, float] | None = None
    ) -> None:
        """Fold in that work with ``arguments`` took ``seconds``.

        With ``bracket``, the duration was only seen to lie within it (and
        ``seconds`` is the value to fit): the prediction's error is its
        distance to the bracket. A measurement whose features or duration are
        not finite is ignored. One the model predicted within 1.5% only
        updates its error, but for a full update now and then (the fit, the
        scores, the measured points).
        """
        features = self.features(arguments)
        if not math.isfinite(seconds) or not all(map(math.isfinite, features)):
            return
        best = self._best
        if best is not None:
            # The prediction as it stood (what predict() gives), then both ways scored.
            line, local = self._predictions(best, features)
            predicted = local if self._prefer_local and local is not None else line
            if bracket is None:
                off, actual = abs(predicted - seconds), seconds
            else:
                low, high = bracket
                off, actual = (
                    max(low - predicted, predicted - high, 0.0),
                    min(max(predicted, low), high),
                )
            error = off / (max(actual, _SMALLEST_COST) + MEASUREMENT_BLUR)
            self.relative_error += (min(error, 4.0) - self.relative_error) / 4
            self.checked += 1
            if error < _ACCURATE and self.samples >= 8 and self.checked % _REFIT_EVERY:
                return  # nothing new to learn; the update costs more than the check
            self._judge(line, local, seconds)
        self._remember(features, seconds, None if best is None else best[2])
        if len(self._sums) != len(features):  # the first sample (or the arity changed)
            self._sums = [[0.0] * 6 for _ in features]
            self._scale = 1.0
        # Forgetting without touching the sums: each sample weighs 1/_FORGET more than the
        # one before (the fit reads ratios of sums, which a common factor leaves alone).
        scale = self._scale = self._scale / _FORGET
        if scale > _RESCALE_AT:
            for sums in self._sums:
                for slot in range(6):
                    sums[slot] /= scale
            scale = self._scale = 1.0
        weight = scale / max(seconds, 10e-6) ** 2
        timed = weight * seconds
        squared = timed * seconds
        for sums, x in zip(self._sums, features, strict=True):
            weighted = weight * x
            sums[0] += weight
            sums[1] += weighted
            sums[2] += weighted * x
            sums[3] += timed
            sums[4] += squared
            sums[5] += weighted * seconds
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

    def _remember(self, features: tuple[float, ...], seconds: float, best: int | None) -> None:
        """Move the measured point of a feature's quarter octave toward this measurement.

        Every feature's while the model is young (which feature predicts best
        is still open); after that only the predicting feature's (``best``),
        the only one whose points are read.
        """
        local = self._local
        if len(local) >= _LOCAL_AT_MOST:
            local.clear()
        if best is None or self.samples < _REMEMBER_EVERY_FEATURE_UNTIL or best >= len(features):
            indexes: Sequence[int] = range(len(features))
        else:
            indexes = (best,)
        for index in indexes:
            x = features[index]
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

    def takes_lesson(self, seen_at: float) -> bool:
        """Whether a completion seen at ``seen_at`` may move this model.

        Yes while it is young (its first :data:`_LEARN_FREELY_UNTIL` checked
        predictions); after that, one completion per :data:`LESSON_INTERVAL`
        (the first after the interval takes it and starts the next).
        """
        if self.checked < _LEARN_FREELY_UNTIL:
            return True
        if seen_at < self.next_lesson:
            return False
        self.next_lesson = seen_at + LESSON_INTERVAL
        return True

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
    sums: dict[CostModel, tuple[float, ...]] = {}
    for model, arguments, _ in burst:
        features = model.features(arguments)
        total = sums.get(model)
        sums[model] = features if total is None else tuple(map(operator.add, total, features))
    return tuple(itertools.chain.from_iterable(sums.values()))


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
        return None if cost is None else (cost, model.spread(cost))

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
            spread += model.spread(cost, 0.25)
        return end, spread

    def confirm(self, burst: Sequence[Item]) -> None:
        """A burst ended where its model said it would, as far as a sighting could tell."""
        model, _ = self._model_of(burst)
        if model is not None:
            model.confirm()

    def learn(
        self,
        burst: Sequence[Item],
        seconds: float,
        bracket: tuple[float, float] | None,
        seen_at: float,
    ) -> None:
        """A burst seen complete at ``seen_at`` took ``seconds``, or about that within ``bracket``.

        ``bracket`` ``None``: measured. The model moves if it takes the lesson
        (:meth:`CostModel.takes_lesson`); call this only where the sighting would
        move the model, as a lesson taken is the interval's.
        """
        model, arguments = self._model_of(burst)
        if model is None:
            model = self._new_burst_model(burst)
        elif not model.takes_lesson(seen_at):
            return
        model.learn(arguments, seconds, bracket)

    def models(self) -> list[CostModel]:
        """Every model, for diagnostics."""
        return [*self._models.values(), *self._bursts.values()]
