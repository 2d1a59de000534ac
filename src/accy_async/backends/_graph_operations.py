"""A backend's graph operations: instantiate kernel graphs once, launch them as one submission.

See :mod:`._graph_exec` for what a graph is. Both operations check everything
before the device is asked (live artifacts, buffers and events, argument
counts) and call the primitives ``_instantiate_graph`` and ``_launch_graph``.
The defaults here replay a graph node by node on the stream (the CPU and
recording backends); CUDA overrides them with device graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio.lowlevel

from ..errors import InvalidArtifact, InvalidBuffer, LaunchArgumentMismatch
from ._core import BackendCore
from ._graph_exec import GraphExec, GraphNode, NodeArguments, check_graph_nodes
from ._handles import EventHandle, LoadedArtifact, StreamHandle, StreamLike

__all__ = ["GraphOperations"]


class GraphOperations(BackendCore):
    """Kernel graphs: made once with :meth:`instantiate_graph`, launched many times."""

    def instantiate_graph(self, nodes: Sequence[GraphNode]) -> GraphExec:
        """A graph of ``nodes``, ready to launch; destroy it exactly once.

        Each node's kernel must be a live loaded artifact of this backend and may
        come only after earlier nodes (:class:`LaunchArgumentMismatch` otherwise,
        naming the node). The nodes' geometry is fixed; their arguments come
        with each launch.
        """
        self._check_usable()
        nodes = tuple(nodes)
        check_graph_nodes(nodes)
        for index, node in enumerate(nodes):
            if not self.owns(node.loaded):
                raise InvalidArtifact(
                    f"{node.loaded!r} is not a live artifact of this backend",
                    path=f"$.nodes[{index}].loaded",
                )
        object_id = self._registry.new_id()
        graph = GraphExec(
            self.backend_id, object_id, self._instantiate_graph(object_id, nodes), nodes
        )
        self._registry.add(graph)
        return graph

    async def prepare_graph_kernels(self, loaded: Sequence[LoadedArtifact]) -> None:
        """Ready ``loaded`` kernels for graphs, off the event loop; always a checkpoint.

        On CUDA each kernel gets (once) an argument-table variant: graph nodes of
        it read their arguments from a device table, which a launch with new
        arguments fills with one stream-ordered copy, where a node without one
        is patched by a driver call each (about a kernel launch's cost). Graphs
        instantiated afterwards use the variants; a kernel that cannot have one
        (a cubin without PTX, a parameter used other than by loading it) keeps
        patched nodes. Optional: :meth:`instantiate_graph` works without it.
        ``launch_pipeline`` and ``launch_graph`` call it before their first
        device graph. Other backends have nothing to prepare. Raises
        :class:`InvalidArtifact` for an artifact that is not live here.
        """
        self._check_usable()
        loaded = tuple(loaded)
        for index, each in enumerate(loaded):
            if not self.owns(each):
                raise InvalidArtifact(
                    f"{each!r} is not a live artifact of this backend", path=f"$.loaded[{index}]"
                )
        await anyio.lowlevel.checkpoint()
        await self._prepare_graph_kernels(loaded)

    async def _prepare_graph_kernels(self, loaded: tuple[LoadedArtifact, ...]) -> None:
        """Make what graphs of ``loaded`` can use (default: nothing)."""
        del loaded

    def launch_graph_exec(
        self,
        graph: GraphExec,
        arguments: Sequence[NodeArguments],
        *,
        stream: StreamLike | None = None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
    ) -> None:
        """Enqueue one launch of ``graph`` on ``stream``: every node, as one submission.

        ``arguments`` holds each node's ``(buffers, scalars)`` in node order;
        only what changed since the graph's last launch is patched in. The
        launch first waits (on the device) for ``wait_events``; ``signal_event``
        is recorded once every node has run. Launches of one graph run one
        after the other, also when given different streams.
        """
        self._check_usable()
        self.collect_deferred()
        if not self.owns(graph):
            raise InvalidBuffer(f"{graph!r} is not a live graph of this backend")
        if len(arguments) != len(graph.nodes):
            raise LaunchArgumentMismatch(
                f"the graph has {len(graph.nodes)} nodes, got arguments for {len(arguments)}",
                path="$.arguments",
            )
        for index, (node, (buffers, scalars)) in enumerate(
            zip(graph.nodes, arguments, strict=True)
        ):
            artifact = node.loaded.artifact
            if not self.owns(node.loaded):
                raise InvalidArtifact(f"{node.loaded!r} of node {index} is no longer loaded")
            if len(buffers) != artifact.buffer_argument_count or len(scalars) != (
                artifact.scalar_argument_count
            ):
                raise LaunchArgumentMismatch(
                    f"{artifact.spec.kernel_name} takes {artifact.buffer_argument_count} "
                    f"buffers and {artifact.scalar_argument_count} scalars, got "
                    f"{len(buffers)} and {len(scalars)}",
                    path=f"$.arguments[{index}]",
                )
            self.check_bindings(buffers, f"$.arguments[{index}].buffers")
        for event in (*wait_events, *([signal_event] if signal_event is not None else [])):
            if not self.owns(event):
                raise InvalidBuffer(f"{event!r} is not a live event of this backend")
        # A fresh tuple: the checked path never takes the arguments as unchanged by identity.
        arguments = tuple(arguments)
        self._enqueue_graph(graph, arguments, self._stream(stream), wait_events, signal_event)

    def launch_graph_exec_trusted(
        self,
        graph: GraphExec,
        arguments: Sequence[NodeArguments],
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
    ) -> None:
        """:meth:`launch_graph_exec` without the per-launch checks: the hot path.

        For callers that checked, once, that the graph, its kernels, every
        buffer and every event are live here and the counts fit (the
        pipeline runner does). A closed or faulted backend still refuses.
        Passing the very ``arguments`` object of the graph's last launch
        again tells the backend nothing changed (nothing is packed or
        patched): never change such an object in place.
        """
        if self._health.refusal is not None:
            self._health.refuse()
        self._enqueue_graph(
            graph,
            arguments,
            self.default_stream if stream is None else stream,
            wait_events,
            signal_event,
        )

    def _enqueue_graph(
        self,
        graph: GraphExec,
        arguments: Sequence[NodeArguments],
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
    ) -> None:
        if self.tracer is None:
            self._launch_graph(graph, arguments, stream, wait_events, signal_event)
        else:
            self._traced(
                "graph",
                f"graph {graph.id} of {len(graph.nodes)} nodes",
                stream,
                lambda: self._launch_graph(graph, arguments, stream, (), None),
                wait_events=wait_events,
                signal_event=signal_event,
                nodes=[node.loaded.artifact.spec.kernel_name for node in graph.nodes],
            )
        graph.last_stream = stream

    # ----- the defaults: a graph replayed node by node ---------------------------------------

    def _instantiate_graph(self, object_id: int, nodes: tuple[GraphNode, ...]) -> Any:
        """The backend's form of a graph (default: replayed node by node).

        Its form is a private event recorded after each launch, so a launch on
        another stream than the last (:attr:`GraphExec.last_stream`) waits, on
        the device, for the one before, as CUDA orders launches of one graph.
        """
        native = self._create_event(-object_id, False)
        return EventHandle(self.backend_id, -object_id, native, timing=False)

    def _launch_graph(
        self,
        graph: GraphExec,
        arguments: Sequence[NodeArguments],
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
    ) -> None:
        """Enqueue every node of ``graph`` on ``stream`` (default: one launch per node)."""
        done: EventHandle = graph.native
        waits = list(wait_events)
        if graph.last_stream is not None and graph.last_stream is not stream:
            waits.append(done)
        for index, (node, (buffers, scalars)) in enumerate(
            zip(graph.nodes, arguments, strict=True)
        ):
            self._launch(
                node.loaded,
                buffers,
                scalars,
                node.config,
                stream,
                waits if index == 0 else (),
                None,
                node.loaded.artifact.spec.diagnostic_id,
            )
        self._record(done, stream)
        if signal_event is not None:
            self._record(signal_event, stream)

    def _destroy_graph(self, graph: GraphExec) -> None:
        """Release the backend's form of ``graph`` (default: the replay's private event)."""
        self._destroy(graph.native)
