"""What a backend offers a waiter: a mark of a stream's work so far, a pending read.

:mod:`accy_async.waiting` watches these as it watches events (queried from the loop,
anticipated by the forecast, or called back by the backend).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from ._completion import CompletionCallback, CompletionRegistration
from .forecast import Anticipation

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["PendingRead", "StreamMark"]


class StreamMark(abc.ABC):
    """The work a stream had when it was marked (:meth:`Backend.mark_stream`).

    Use it from the event loop's thread, then :meth:`release` it exactly once,
    whether the wait completed, failed or was cancelled.
    """

    __slots__ = ()

    @property
    @abc.abstractmethod
    def backend(self) -> Backend:
        """The backend whose stream was marked."""

    @abc.abstractmethod
    def query(self) -> bool:
        """Whether that work has completed; never blocks; raises the backend's fault."""

    @abc.abstractmethod
    def anticipate(self) -> Anticipation | None:
        """When it should complete, as :meth:`Backend.anticipate` tells for events."""

    @abc.abstractmethod
    def notify_when_complete(self, callback: CompletionCallback) -> CompletionRegistration:
        """Call ``callback`` (from any thread) once it completes or cannot."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the mark back to the backend."""


class PendingRead(abc.ABC):
    """A device-to-host copy enqueued on a stream.

    Await it with :func:`accy_async.waiting.wait_read`, or register a callback
    with :meth:`notify_when_complete`, then take :meth:`result`.
    """

    __slots__ = ()

    @abc.abstractmethod
    def notify_when_complete(self, callback: CompletionCallback) -> CompletionRegistration:
        """Call ``callback`` once the copy has landed (or cannot)."""

    def stream_mark(self) -> StreamMark | None:
        """The point in the stream where the copy has landed, if the backend has one.

        :func:`accy_async.waiting.wait_read` watches it as it watches stream
        marks; the read owns it (do not release it). ``None`` by default.
        """
        return None

    @abc.abstractmethod
    def result(self) -> memoryview:
        """The bytes read; call only after completion."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Give up on the read (after an error or cancellation); releases what it holds."""
