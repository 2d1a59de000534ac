"""A bounded cache of instantiated device graphs, shared by pipelines' pools and loaded kernels.

Keyed by what fixes a graph's topology and geometry (a plan and each node's
:class:`~accy_async.backends.LaunchConfig`); the least recently used graph
beyond the capacity is retired, and retired graphs are destroyed once every
stream the owner ran on is seen idle (checked, without waiting, whenever a
graph is made), or with the owner when it closes: never while a launch of
them may still run. A backend that cannot instantiate graphs is remembered (``unavailable``)
so that automatic callers stop asking.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Final

import anyio

from .backends import Backend, GraphExec, GraphNode, LoadedArtifact, StreamHandle
from .errors import RuntimeUnavailable, UnsupportedOperation

__all__ = ["GRAPH_CAPACITY", "GraphCache"]

GRAPH_CAPACITY: Final = 16
"""Graphs one cache keeps instantiated."""

_logger: Final = logging.getLogger("accy_async")


class GraphCache:
    """Instantiated graphs by key; see the module docstring."""

    __slots__ = (
        "_preparing",
        "_retired",
        "backend",
        "capacity",
        "graphs",
        "prepared",
        "unavailable",
    )

    def __init__(self, backend: Backend, capacity: int = GRAPH_CAPACITY) -> None:
        self.backend = backend
        self.capacity = capacity
        self.graphs: OrderedDict[Hashable, GraphExec] = OrderedDict()
        self.unavailable: str | None = None
        """Why graphs are not used here (the backend could not instantiate one), if so."""
        self.prepared = False
        """Whether the owner's kernels were readied for graphs (:meth:`prepare`)."""
        self._preparing: anyio.Lock | None = None
        self._retired: list[GraphExec] = []

    async def prepare(self, loaded: Sequence[LoadedArtifact]) -> None:
        """Ready the owner's ``loaded`` kernels for graphs, the first time only.

        See :meth:`~accy_async.backends.Backend.prepare_graph_kernels`; call it
        (a checkpoint) before the first graph is made, so its nodes read their
        arguments from a table rather than being patched one by one.
        """
        if self._preparing is None:
            self._preparing = anyio.Lock()
        async with self._preparing:  # tasks launching at once make the variants once
            if not self.prepared:
                await self.backend.prepare_graph_kernels(loaded)
                self.prepared = True

    def cached(self, key: Hashable) -> GraphExec | None:
        """The graph made for ``key``, now the most recently used; ``None`` if none is."""
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
        return graph

    def get(
        self,
        key: Hashable,
        nodes: Callable[[], Sequence[GraphNode]],
        streams: Callable[[], Iterable[StreamHandle | None]],
        *,
        wanted: bool | None,
        what: str,
    ) -> GraphExec | None:
        """The graph for ``key``, instantiated from ``nodes()`` on first use.

        ``wanted`` is the caller's choice: ``True`` raises when the graph
        cannot be made; ``None`` returns ``None`` then (and from then on),
        logging once that ``what`` launches node by node. ``streams()`` are
        the streams an evicted graph may still run on.
        """
        graph = self.cached(key)
        if graph is not None:
            return graph
        if self.unavailable is not None and wanted is not True:
            return None
        try:
            graph = self.backend.instantiate_graph(nodes())
        except (RuntimeUnavailable, UnsupportedOperation) as exc:
            if wanted is True:
                raise
            self.unavailable = str(exc)
            _logger.warning("accy-async: %s launches node by node: no graph (%s)", what, exc)
            return None
        self.graphs[key] = graph
        if len(self.graphs) > self.capacity:
            self._retired.append(self.graphs.popitem(last=False)[1])
        if self._retired:
            self._destroy_retired_if_idle(streams())
        return graph

    def _destroy_retired_if_idle(self, streams: Iterable[StreamHandle | None]) -> None:
        backend = self.backend
        if all(backend.query_stream(s) for s in streams if s is None or backend.owns(s)):
            retired, self._retired = self._retired, []
            backend.destroy_all(retired)

    def __len__(self) -> int:
        return len(self.graphs)

    def take_all(self) -> list[GraphExec]:
        """Every graph held, cached or retired, forgotten here (to release with their owner)."""
        graphs = [*self.graphs.values(), *self._retired]
        self.graphs.clear()
        self._retired = []
        return graphs
