"""The launch of one kernel with its arguments bound once: what pipelines and graphs call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..plan import ScalarArgument
from ._handles import BufferBinding, EventHandle, LoadedArtifact, StreamHandle
from ._launch_config import LaunchConfig

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["StageLauncher"]


class StageLauncher:
    """Launches one loaded kernel without per-launch checks: the hot path.

    Made by :meth:`Backend.stage_launcher`. The caller checks its buffers and
    counts once, then either calls the launcher with bindings and scalars,
    or, to launch the same arguments many times, turns them into a
    backend-specific packed form once with :meth:`prepare` and launches that
    with :meth:`launch_prepared`. A closed or faulted backend still refuses.
    """

    __slots__ = ("backend", "loaded")

    def __init__(self, backend: Backend, loaded: LoadedArtifact) -> None:
        self.backend = backend
        self.loaded = loaded

    def __call__(
        self,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        config: LaunchConfig,
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
    ) -> None:
        """Enqueue one launch of the bound kernel."""
        self.backend.launch_trusted(
            self.loaded,
            buffers,
            scalars,
            config,
            stream,
            wait_events,
            signal_event,
            self.loaded.artifact.spec.diagnostic_id,
        )

    def prepare(self, buffers: Sequence[BufferBinding], scalars: Sequence[ScalarArgument]) -> Any:
        """The arguments in the form :meth:`launch_prepared` takes."""
        return (tuple(buffers), tuple(scalars))

    def launch_prepared(
        self,
        prepared: Any,
        config: LaunchConfig,
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
    ) -> None:
        """Enqueue one launch with arguments from :meth:`prepare`."""
        self(prepared[0], prepared[1], config, stream, wait_events, signal_event)
