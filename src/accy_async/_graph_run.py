"""What :func:`~accy_async.graph.launch_graph` hands back: the run and each node's completion.

A :class:`GraphRun` is returned once everything is enqueued; it awaits the
whole graph (every stream of the run) or, through :class:`NodeCompletion`,
any one node. :mod:`accy_async.graph` re-exports both.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Mapping, Sequence

import anyio

from ._graph_schedule import Schedule
from ._loops import checkpoint
from .backends import Backend, EventHandle, StreamHandle, StreamMark
from .errors import AccyError
from .waiting import CompletionLatch, await_mark, wait_event

__all__ = ["GraphRun", "NodeCompletion", "StreamEnd"]


_dropped_marks: deque[StreamMark] = deque()
"""Marks of runs dropped before their end was seen, released by the next run on the loop."""


class StreamEnd:
    """The end of a run's work on one stream, awaited the way :func:`wait_stream` waits.

    Where the backend marks streams (CUDA) it is a mark, queried and watched
    from the loop by the backend's wait policy, and handed back to the backend
    once seen complete; a run dropped before that hands its mark to the next
    run made, which releases it on the loop's thread (a finalizer takes no
    locks). Elsewhere it is a latch the backend fires.
    """

    __slots__ = ("_backend", "_latch", "_mark")

    _drop = _dropped_marks.append
    """Bound once: a finalizer at interpreter exit needs no module global."""

    def __init__(self, backend: Backend, stream: StreamHandle | None) -> None:
        while _dropped_marks:
            mark = _dropped_marks.popleft()
            with contextlib.suppress(AccyError):  # its backend failed since: nothing to give
                mark.release()
        self._backend = backend
        self._mark: StreamMark | None = backend.mark_stream(stream)
        self._latch: CompletionLatch | None = None
        if self._mark is None:
            self._latch = CompletionLatch()
            backend.notify_when_stream_complete(stream, self._latch)

    @property
    def done(self) -> bool:
        """Whether the work is known to have completed (or failed: :meth:`wait` raises)."""
        mark = self._mark
        if mark is None:
            return self._latch is None or self._latch.done
        try:
            if not mark.query():
                return False
        except AccyError:  # the device failed: wait() raises it
            return True
        self._release()
        return True

    async def wait(self) -> None:
        """Return once the work has completed (a checkpoint); raise the backend's fault."""
        mark = self._mark
        if mark is not None:
            await await_mark(self._backend, mark, None)
            self._release()
        elif self._latch is not None:
            await self._latch.wait()
        else:  # seen complete before
            await checkpoint()

    def _release(self) -> None:
        # Seen complete: given back now. Another task still watching it queries a completed
        # mark, which answers from its own flag and never reads the (recycled) marker again.
        mark, self._mark = self._mark, None
        if mark is not None:
            mark.release()

    def __del__(self) -> None:
        mark = getattr(self, "_mark", None)
        if mark is not None:
            self._drop(mark)  # an append: no lock, whichever thread collects the run


class NodeCompletion:
    """Awaitable completion of one node of a :class:`GraphRun`.

    It completes when the earliest marker recorded on the node's stream at or
    after the node has: the node's own dependency event if it has one, else
    that of the next producer on its stream, else the stream's end of the
    run. For a node inside a loop, that is its last iteration.
    """

    __slots__ = ("_backend", "_event", "_tail", "index")

    def __init__(
        self,
        index: int,
        backend: Backend,
        event: EventHandle | None,
        tail: StreamEnd,
    ) -> None:
        self.index = index
        self._backend = backend
        self._event = event
        self._tail = tail

    @property
    def done(self) -> bool:
        """Whether the node is known to have completed."""
        if self._tail.done:
            return True
        return self._event is not None and self._backend.query_event(self._event)

    async def wait(self) -> None:
        """Return once the node has completed on the device."""
        # The run's events are released only after every stream of the run has
        # finished, so while this node's stream has not, its event is alive.
        if self._event is None or self._tail.done:
            await self._tail.wait()
        else:
            await wait_event(self._backend, self._event)


class GraphRun:
    """A launched graph: everything is enqueued; await the whole or any node.

    The run owns nothing that needs closing: its dependency events and the
    streams it created are released by the backend once the device has
    finished with them.
    """

    __slots__ = (
        "_backend",
        "_events",
        "_schedule",
        "_stream_tails",
        "_tails",
        "enqueued_launches",
    )

    def __init__(
        self,
        backend: Backend | None = None,
        schedule: Schedule | None = None,
        tails: Sequence[StreamEnd] = (),
        stream_tails: Sequence[StreamEnd] = (),
        events: Mapping[int, EventHandle] | None = None,
        enqueued_launches: int = 0,
    ) -> None:
        self._backend = backend
        self._schedule = schedule
        self._tails = tuple(tails)
        self._stream_tails = tuple(stream_tails)
        """The end of each of the schedule's streams (by ``stream_keys`` position)."""
        self._events = events or {}
        self.enqueued_launches = enqueued_launches
        """How many kernel launches the run enqueued (loops counted per iteration)."""

    @property
    def done(self) -> bool:
        """Whether every stream of the run is known to have finished."""
        return all(latch.done for latch in self._tails)

    async def wait(self) -> None:
        """Return once all the run's work has completed on the device (a checkpoint)."""
        if not self._tails:
            await checkpoint()
        for latch in self._tails:
            await latch.wait()

    def node(self, index: int) -> NodeCompletion:
        """The completion of node ``index``."""
        if self._backend is None or self._schedule is None:
            raise IndexError(f"node {index} does not exist: the run has no nodes")
        producer = self._schedule.completion_producer[index]
        event = self._events.get(producer) if producer >= 0 else None
        tail = self._stream_tails[self._schedule.node_stream[index]]
        return NodeCompletion(index, self._backend, event, tail)

    async def __aenter__(self) -> GraphRun:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=exc_info[0] is not None):
            await self.wait()
