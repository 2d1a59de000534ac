"""Instantiated graphs: several kernel launches made once, replayed as one submission.

A :class:`GraphExec` is a fixed set of kernel nodes (each a loaded kernel at a
:class:`~._launch_config.LaunchConfig`, after the nodes it depends on) that a
backend instantiated once. Each launch of it passes every node's buffers and
scalars; only what changed since its last launch is patched into it (on CUDA,
``cuGraphExecKernelNodeSetParams``), and the whole graph goes to the stream as
one submission (``cuGraphLaunch``). Launches of one graph run one after the
other, also from different streams (as CUDA orders them). On backends without
device graphs the graph is a recorded program replayed node by node on the
stream, with the same semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ..errors import LaunchArgumentMismatch
from ..plan import ScalarArgument
from ._handles import BufferBinding, DeviceObject, LoadedArtifact, StreamHandle
from ._launch_config import LaunchConfig

__all__ = ["GraphExec", "GraphNode", "NodeArguments", "check_graph_nodes"]

NodeArguments: TypeAlias = tuple[Sequence[BufferBinding], Sequence[ScalarArgument]]
"""One node's buffers and scalars for one launch of a graph."""


@dataclass(frozen=True, slots=True)
class GraphNode:
    """A kernel node: ``loaded`` at ``config``, after the nodes listed in ``after``.

    ``after`` holds indices of earlier nodes of the same graph (a graph's nodes
    are given in an order where each comes after what it depends on).
    """

    loaded: LoadedArtifact
    config: LaunchConfig
    after: tuple[int, ...] = ()


class GraphExec(DeviceObject):
    """An instantiated graph of kernel nodes; destroy it exactly once.

    Made by :meth:`~accy_async.backends.Backend.instantiate_graph`; launched
    with :meth:`~accy_async.backends.Backend.launch_graph_exec`. ``nodes``
    are the nodes it was made of; ``native`` is the backend's own.
    """

    __slots__ = ("last_stream", "nodes")
    kind = "graph"

    def __init__(
        self, backend_id: int, object_id: int, native: Any, nodes: tuple[GraphNode, ...]
    ) -> None:
        super().__init__(backend_id, object_id, native)
        self.nodes = nodes
        self.last_stream: StreamHandle | None = None
        """The stream of its last launch, ``None`` before the first. A launch on another
        stream runs after that one ends: callers that choose by themselves whether to
        use a graph keep to its stream, so streams stay concurrent."""


def check_graph_nodes(nodes: Sequence[GraphNode]) -> None:
    """Refuse an empty graph or a dependency that is not an earlier node, naming the node."""
    if not nodes:
        raise LaunchArgumentMismatch("a graph needs at least one node", path="$.nodes")
    for index, node in enumerate(nodes):
        if not isinstance(node, GraphNode):
            raise LaunchArgumentMismatch(
                f"expected a GraphNode, got {type(node).__name__}", path=f"$.nodes[{index}]"
            )
        if len(set(node.after)) != len(node.after) or not all(
            type(before) is int and 0 <= before < index for before in node.after
        ):
            raise LaunchArgumentMismatch(
                f"node {index} may only come after earlier nodes, each once; got {node.after}",
                path=f"$.nodes[{index}].after",
            )
