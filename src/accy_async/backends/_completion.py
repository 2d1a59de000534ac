"""The one completion primitive every backend uses: :class:`Completion`.

An event's record, a stream mark, a read, a watch of the CUDA reactor and an
awaitable latch are all "something that completes once, possibly on another
thread, with success or the error that prevents it". :class:`Completion` is
that: call it (from any thread) to fire it; register callbacks before or
after it fires; withdraw a callback that has not run.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Final, TypeAlias

__all__ = [
    "ALREADY_FIRED",
    "Completion",
    "CompletionCallback",
    "CompletionRegistration",
]

CompletionCallback: TypeAlias = Callable[[BaseException | None], None]
"""Called once, from any thread, with ``None`` on completion or the error that prevents it."""


class CompletionRegistration(abc.ABC):
    """A pending completion callback; :meth:`cancel` withdraws it if it has not fired."""

    __slots__ = ()

    @abc.abstractmethod
    def cancel(self) -> bool:
        """Withdraw the callback. ``True`` if it will not be called, ``False`` if it fired."""


class _AlreadyFired(CompletionRegistration):
    __slots__ = ()

    def cancel(self) -> bool:
        return False


ALREADY_FIRED: Final[CompletionRegistration] = _AlreadyFired()
"""The registration of a callback that ran before its registration returned."""


class Completion:
    """Completes once, from any thread, with ``None`` or the error that prevents it.

    It is itself a :data:`CompletionCallback`: calling it fires it, and only
    the first call counts. Callbacks registered before it fires run then, in
    registration order, on the firing thread; registered after, they run at
    once on the registering thread. :attr:`done` and :attr:`error` may be read
    without a lock: ``done`` is set before any callback runs.
    """

    __slots__ = ("_callbacks", "_lock", "done", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[CompletionCallback] | None = None
        self.done = False
        """Whether it has fired."""
        self.error: BaseException | None = None
        """The error it fired with, if any."""

    def __call__(self, error: BaseException | None = None) -> None:
        """Fire (from any thread); later calls are ignored."""
        with self._lock:
            if self.done:
                return
            self.error = error
            self.done = True
            callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            for callback in callbacks:
                callback(error)

    def register(self, callback: CompletionCallback) -> CompletionRegistration:
        """Call ``callback`` once this fires (at once, on this thread, if it has)."""
        with self._lock:
            if not self.done:
                if self._callbacks is None:
                    self._callbacks = [callback]
                else:
                    self._callbacks.append(callback)
                return _Registration(self, callback)
        callback(self.error)
        return ALREADY_FIRED

    def withdraw(self, callback: CompletionCallback) -> bool:
        """Remove ``callback`` (that very object); ``False`` if it fired or was never there."""
        with self._lock:
            callbacks = self._callbacks
            if callbacks:
                for index, registered in enumerate(callbacks):
                    if registered is callback:
                        del callbacks[index]
                        return True
            return False


class _Registration(CompletionRegistration):
    __slots__ = ("_callback", "_completion")

    def __init__(self, completion: Completion, callback: CompletionCallback) -> None:
        self._completion = completion
        self._callback = callback

    def cancel(self) -> bool:
        return self._completion.withdraw(self._callback)
