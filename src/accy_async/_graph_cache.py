"""A bounded cache of instantiated device graphs, shared by pipelines' pools and loaded kernels.

Keyed by what fixes a graph's topology and geometry (a plan and each node's
:class:`~accy_async.backends.LaunchConfig`); the least recently used graph
beyond the capacity is destroyed once the streams it ran on are done with
it. A backend that cannot instantiate graphs is remembered (``unavailable``)
so that automatic callers stop asking.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Final

from .backends import Backend, GraphExec, GraphNode, StreamHandle
from .errors import RuntimeUnavailable, UnsupportedOperation

__all__ = ["GRAPH_CAPACITY", "GraphCache"]

GRAPH_CAPACITY: Final = 16
"""Graphs one cache keeps instantiated."""

_logger: Final = logging.getLogger("accy_async")


class GraphCache:
    """Instantiated graphs by key; see the module docstring."""

    __slots__ = ("backend", "capacity", "graphs", "unavailable")

    def __init__(self, backend: Backend, capacity: int = GRAPH_CAPACITY) -> None:
        self.backend = backend
        self.capacity = capacity
        self.graphs: OrderedDict[Hashable, GraphExec] = OrderedDict()
        self.unavailable: str | None = None
        """Why graphs are not used here (the backend could not instantiate one), if so."""

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
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
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
            _, evicted = self.graphs.popitem(last=False)
            backend = self.backend
            live = [s for s in streams() if s is None or backend.owns(s)]
            backend.defer_destroy([evicted], after=live)
        return graph

    def __len__(self) -> int:
        return len(self.graphs)

    def take_all(self) -> list[GraphExec]:
        """Every cached graph, forgotten here (to release with their owner)."""
        graphs = list(self.graphs.values())
        self.graphs.clear()
        return graphs
