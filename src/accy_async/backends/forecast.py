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
moves a model only when its prediction lies outside the bracket (its error
is its distance to the bracket); inside it, the model grows surer of itself
only if the bracket is no wider than its spread. Errors are relative to the
duration plus the polls' blur (``MEASUREMENT_BLUR``), so short kernels seen
tens of microseconds off do not make a long kernel of the same model unsure. A model
predicts ``a + b * x`` for whichever of its features ``x`` (threads
launched, each scalar, bytes) has fitted its history best, each sample
weighted by the inverse square of its length so relative errors count
alike: a kernel whose length follows its size or a scalar is predicted
after a few completions; one that always takes as long, after one.

Sightings cost a waiter nothing: :meth:`Ledger.sighted` queues them (from
any thread: the loop's polls, the CUDA reactor's), and they are folded in on
the loop's thread the next time the ledger is used, after the waiter has
resumed. A model that already predicts within 1.5% skips most updates, and a model past
its first 32 checked predictions moves for at most one completion a millisecond
(:data:`~._cost_models.LESSON_INTERVAL`, counted over every stream that shares it): a
service of thousands of small requests a second would otherwise spend more CPU learning
than its kernels run. A settled model whose kernel changes cost follows at that pace.

The cost models (:class:`CostModel`, :class:`Forecast`) live in
:mod:`._cost_models`; this module keeps the ledgers and re-exports them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Final, NamedTuple

from ._cost_models import (
    LAUNCH_LATENCY,
    MEASUREMENT_BLUR,
    CostModel,
    Forecast,
    Item,
    byte_features,
    launch_features,
)

__all__ = [
    "LAUNCH_LATENCY",
    "MEASUREMENT_BLUR",
    "Anticipation",
    "CostModel",
    "Forecast",
    "Ledger",
    "byte_features",
    "launch_features",
]

_BURST_GAP: Final = 50e-6
"""Items enqueued within this of the one before belong to its burst."""

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


class Anticipation(NamedTuple):
    """When a point of a stream should complete: see :meth:`Backend.anticipate`."""

    due: float
    """The predicted completion, a :func:`time.perf_counter` instant."""
    spread: float
    """How far off such predictions have typically been, in seconds."""


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
                    MEASUREMENT_BLUR, 0.04 * (seen_at - begin)
                )
                lower = 0.0 if pending_at is None else pending_at - begin
                self._learn(last, lower, seen_at - begin, narrow, seen_at)
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

    def _learn(
        self, burst: list[Item], lower: float, upper: float, narrow: bool, seen_at: float
    ) -> None:
        forecast = self.forecast
        if narrow:
            forecast.learn(burst, (lower + upper) / 2, None, seen_at)
            return
        # Seen too coarsely to measure: move a model only if it predicts outside the bracket;
        # inside it, the prediction stands, and counts as a right one only if the bracket is
        # no wider than the model claims to be sure (a wait that looks once, long after the
        # due time, must not make a model that runs long surer of itself).
        finished = forecast.finish(burst, 0.0)
        target = (lower + upper) / 2 if lower > 0 else upper
        low = max(lower, 0.0)
        if finished is None or not lower <= finished[0] - burst[0][2] - LAUNCH_LATENCY <= upper:
            forecast.learn(burst, target, (low, upper), seen_at)
        elif upper - low <= max(2 * finished[1], MEASUREMENT_BLUR):
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
