"""The backend contract: the :class:`Backend` base class and what every backend shares.

:class:`Backend` is what callers use. It is assembled from operation groups,
one module each: the shared state and checks (:mod:`._core`: live objects in a
:class:`~._registry.Registry`, deferred releases, :class:`~._health.Health`),
buffers (:mod:`._buffer_operations`), streams and events
(:mod:`._stream_operations`); this module adds what a backend is, artifacts,
launches, completion and closing. Every public method checks its arguments
and the backend's health, then calls one of the primitives a backend
implements (:class:`~._primitives.BackendPrimitives`). The handles live in
:mod:`._handles`, what a waiter watches in :mod:`._marks`, the bound launch in
:mod:`._launcher`; :mod:`accy_async.backends` exports everything a backend
author needs.

A backend owns device objects (buffers, loaded artifacts, streams, events) and
offers *non-blocking* primitives over them: allocate, enqueue a copy, fill,
launch, record, device-side wait, query. Nothing here blocks the calling
thread on device work; :mod:`accy_async.waiting` turns completion into
something a task can await.

Error contract (after cuda.core's): a failed create leaves nothing behind;
every object created is destroyed exactly once (a second destroy raises
:class:`~accy_async.errors.InvalidBuffer`); a failure while cleaning up becomes
a :class:`ResourceWarning`, never a second exception; when in doubt a leak is
preferred to a dangling pointer (see :meth:`Backend.defer_destroy`).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Final

import anyio
import anyio.lowlevel

from ..errors import (
    DeviceFault,
    InvalidArtifact,
    InvalidBuffer,
    LaunchArgumentMismatch,
    UnsupportedOperation,
)
from ..plan import ArtifactFormat, ArtifactSpec, ScalarArgument
from ._buffer_operations import BufferOperations
from ._completion import CompletionCallback, CompletionRegistration
from ._device_info import DeviceIdentity, Limits, WaitPolicy, check_wait_policy
from ._graph_operations import GraphOperations
from ._handles import (
    BufferBinding,
    EventHandle,
    KernelArtifact,
    LoadedArtifact,
    StreamHandle,
    StreamLike,
    is_external,
)
from ._launch_config import LaunchConfig
from ._launcher import StageLauncher
from ._marks import StreamMark
from ._stream_operations import StreamOperations
from .forecast import Anticipation

if TYPE_CHECKING:  # the trust model sits above the backends; they only hold a policy
    from ..trust import TrustPolicy

__all__ = ["Backend"]

_logger: Final = logging.getLogger("accy_async")


class Backend(BufferOperations, StreamOperations, GraphOperations):
    """A device and the objects created on it; the base of every backend.

    Subclasses implement the ``_``-prefixed primitives; this class keeps the
    live-object registry (every object destroyed exactly once), refuses work
    once the backend is closed or has a sticky :class:`DeviceFault`, checks
    launch arguments, and runs deferred releases. All methods are called from
    the thread that runs the event loop; only completion callbacks arrive on
    other threads.
    """

    polled_from_loop: bool = False
    """Whether waits watch this backend's completions from the event loop itself.

    True where a completion query is cheap, never blocks and needs no other
    thread (CUDA's ``cuEventQuery``): a wait then sleeps until shortly before
    the work is due and polls from the loop, and nothing has to cross threads
    to wake it. Otherwise (the CPU backend, whose queries would contend with
    its worker threads for the GIL) waits are called back by the backend.
    """

    def __init__(
        self, *, limits: Limits | None = None, wait_policy: WaitPolicy = "balanced"
    ) -> None:
        super().__init__()
        self.limits = limits or Limits()
        self.wait_policy = wait_policy
        self.trust_policy: TrustPolicy | None = None
        """CUDA kernels this backend may compile and load (``None``: whatever it is given).

        Set it before accepting plans from others: :meth:`create_artifact`
        then refuses any CUDA payload the policy does not list
        (:class:`~accy_async.errors.UntrustedKernel`). See :mod:`accy_async.trust`."""

    # ----- what a backend is ---------------------------------------------------------------

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The device's name, for logs and the demo."""

    @property
    @abc.abstractmethod
    def formats(self) -> frozenset[ArtifactFormat]:
        """The artifact formats this backend can create and load."""

    @property
    @abc.abstractmethod
    def preferred_formats(self) -> tuple[ArtifactFormat, ...]:
        """Formats to pick a pipeline's registry entries in, best first."""

    @property
    def dlpack_device(self) -> tuple[int, int]:
        """Where this backend's buffers live, as DLPack names a device ``(type, ordinal)``.

        Raises :class:`~accy_async.errors.UnsupportedOperation` on a backend
        whose buffers no other library can read (the recording backend).
        """
        raise UnsupportedOperation(f"the {self.kind} backend's buffers are not real memory")

    @property
    @abc.abstractmethod
    def identity(self) -> DeviceIdentity:
        """The device, driver and compiler this backend runs on (keys tuning results)."""

    @property
    def cache_flush_bytes(self) -> int:
        """Bytes to write to evict the device's last-level cache before a timed sample."""
        return 64 * 1024 * 1024

    @property
    def peak_memory_bandwidth(self) -> float | None:
        """The device memory's theoretical bandwidth in bytes per second; ``None`` if unknown.

        On CUDA: twice the memory clock times the bus width, as the device
        reports them. The CPU and recording backends do not know theirs.
        """
        return None

    @property
    def fault(self) -> DeviceFault | None:
        """The sticky fault that poisoned this backend, if any."""
        return self._health.fault

    @property
    def wait_policy(self) -> WaitPolicy:
        """The :data:`WaitPolicy` of waits that name none (``"balanced"`` by default)."""
        return self._wait_policy

    @wait_policy.setter
    def wait_policy(self, policy: WaitPolicy) -> None:
        check_wait_policy(policy)
        self._wait_policy = policy

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has run."""
        return self._health.closed

    # ----- artifacts -----------------------------------------------------------------------

    async def create_artifact(self, spec: ArtifactSpec) -> KernelArtifact:
        """Create (compile) the artifact ``spec`` describes; slow compiles run off the loop."""
        await anyio.lowlevel.checkpoint()
        self._check_usable()
        if spec.format not in self.formats:
            raise InvalidArtifact(
                f"{self.kind} backend cannot create {spec.format.value!r} artifacts "
                f"(it takes {sorted(f.value for f in self.formats)})"
            )
        if self.trust_policy is not None:
            self.trust_policy.check(spec)
        return await self._create_artifact(spec)

    async def load_artifact(self, artifact: KernelArtifact) -> LoadedArtifact:
        """Load a created artifact onto the device; destroy the result exactly once.

        A cancelled caller gets control back at once; a module its load was
        still making is unloaded by the backend once it is made (nothing leaks).
        """
        await anyio.lowlevel.checkpoint()
        self._check_usable()
        object_id = self._registry.new_id()
        native = await self._load_artifact(object_id, artifact)
        loaded = LoadedArtifact(self.backend_id, object_id, native, artifact)
        self._registry.add(loaded)
        return loaded

    @contextlib.asynccontextmanager
    async def parallel_compilation(self, workers: int) -> AsyncIterator[None]:
        """Within the block, let up to ``workers`` compilations run in parallel.

        For backends whose compiler serialises the compilations of a process
        (NVRTC on CUDA) this starts worker processes for the block; elsewhere
        it does nothing. Blocks may nest; the outermost one decides.
        """
        del workers
        yield

    # ----- launch --------------------------------------------------------------------------

    def launch(
        self,
        loaded: LoadedArtifact,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        config: LaunchConfig,
        *,
        stream: StreamLike | None = None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
        diagnostic_id: str | None = None,
    ) -> None:
        """Enqueue one launch of ``loaded`` on ``stream``, at ``config``'s geometry.

        The launch first waits (on the device) for each of ``wait_events``;
        ``signal_event``, if given, is recorded after it. Buffers come first in
        the kernel's arguments, then scalars; their counts must match the
        artifact's, and every buffer must be live on this backend.
        """
        if self._health.refusal is not None:
            self._health.refuse()
        if self._registry.ready:
            self.collect_deferred()
        if self._live.get(loaded.id) is not loaded:
            raise InvalidArtifact(f"{loaded!r} is not a live artifact of this backend")
        if config.__class__ is not LaunchConfig:
            raise LaunchArgumentMismatch(
                f"the launch's geometry is a LaunchConfig, got {config!r}", path="$.config"
            )
        artifact = loaded.artifact
        if len(buffers) != artifact.buffer_argument_count or len(scalars) != (
            artifact.scalar_argument_count
        ):
            raise LaunchArgumentMismatch(
                f"{artifact.spec.kernel_name} takes {artifact.buffer_argument_count} buffers and "
                f"{artifact.scalar_argument_count} scalars, got {len(buffers)} and {len(scalars)}"
            )
        self.check_bindings(buffers, "$.buffers")
        live = self._live
        for event in wait_events:
            if live.get(event.id) is not event:
                raise InvalidBuffer(f"{event!r} is not a live event of this backend")
        if signal_event is not None and live.get(signal_event.id) is not signal_event:
            raise InvalidBuffer(f"{signal_event!r} is not a live event of this backend")
        self._enqueue_launch(
            loaded,
            buffers,
            scalars,
            config,
            self._stream(stream),
            wait_events,
            signal_event,
            diagnostic_id,
        )

    def launch_trusted(
        self,
        loaded: LoadedArtifact,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        config: LaunchConfig,
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
        diagnostic_id: str | None = None,
    ) -> None:
        """:meth:`launch` without the per-launch argument checks: the hot path.

        For callers that have already checked, once, that ``loaded``, every
        buffer and every event are live objects of this backend and that the
        counts fit the artifact (the pipeline and graph runners do, before
        their first launch). A closed or faulted backend still refuses.
        """
        if self._health.refusal is not None:
            self._health.refuse()
        self._enqueue_launch(
            loaded,
            buffers,
            scalars,
            config,
            self.default_stream if stream is None else stream,
            wait_events,
            signal_event,
            diagnostic_id,
        )

    def _enqueue_launch(
        self,
        loaded: LoadedArtifact,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        config: LaunchConfig,
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
        diagnostic_id: str | None,
    ) -> None:
        """The launch, checked already; recorded when tracing (its span after its waits)."""
        if self.tracer is None:
            self._launch(
                loaded, buffers, scalars, config, stream, wait_events, signal_event, diagnostic_id
            )
            return
        self._traced(
            "launch",
            loaded.artifact.spec.kernel_name,
            stream,
            lambda: self._launch(loaded, buffers, scalars, config, stream, (), None, diagnostic_id),
            wait_events=wait_events,
            signal_event=signal_event,
            config=config,
            **({} if diagnostic_id is None else {"diagnostic_id": diagnostic_id}),
        )

    def stage_launcher(self, loaded: LoadedArtifact) -> StageLauncher:
        """A :class:`StageLauncher` for ``loaded``: the fastest way to launch it many times."""
        return StageLauncher(self, loaded)

    # ----- completion ----------------------------------------------------------------------

    def query_event(self, event: EventHandle) -> bool:
        """Whether ``event``'s latest record has completed; never blocks.

        Raises the backend's :class:`DeviceFault` once it has one.
        """
        if self._health.refusal is not None:
            self._health.refuse()
        return self._query_event(event)

    def query_stream(self, stream: StreamLike | None = None) -> bool:
        """Whether all work enqueued on ``stream`` has completed; never blocks."""
        if self._health.refusal is not None:
            self._health.refuse()
        return self._query_stream(self._stream(stream))

    def notify_when_complete(
        self, event: EventHandle, callback: CompletionCallback
    ) -> CompletionRegistration:
        """Call ``callback`` once ``event``'s latest record completes, from any thread.

        Called with ``None`` on completion or with the :class:`DeviceFault` (or
        :class:`BackendClosed`) that prevents it. If the event is already
        complete the callback may run before this returns.
        """
        if self._health.refusal is not None:
            self._health.refuse()
        return self._notify_when_complete(event, callback)

    def anticipate(self, event: EventHandle) -> Anticipation | None:
        """When ``event``'s latest record should complete, if the backend can tell.

        :func:`accy_async.waiting.wait_event` then wakes shortly before
        ``due`` and watches the event from the event loop's own thread instead
        of waiting to be woken from another thread. ``None`` (the default)
        means no prediction.
        """
        del event
        return None

    def notify_when_stream_complete(
        self, stream: StreamLike | None, callback: CompletionCallback
    ) -> CompletionRegistration:
        """Call ``callback`` once the work enqueued on ``stream`` so far has completed.

        Uses no event the caller can see (the backend's own marker), so it
        creates no device object.
        """
        if self._health.refusal is not None:
            self._health.refuse()
        return self._notify_when_stream_complete(self._stream(stream), callback)

    def mark_stream(self, stream: StreamLike | None) -> StreamMark | None:
        """The work enqueued on ``stream`` so far, as a point a waiter can watch itself.

        :func:`accy_async.waiting.wait_stream` uses it, where a backend offers
        one, to wait as :func:`~accy_async.waiting.wait_event` does; ``None``
        (the default) means waiters use :meth:`notify_when_stream_complete`.
        Uses no object the caller can see; give it back with
        :meth:`StreamMark.release`.
        """
        if self._health.refusal is not None:
            self._health.refuse()
        return self._mark_stream(self._stream(stream))

    # ----- closing ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Wait for queued work, release deferred objects, and close the device.

        Objects still live are destroyed, named in a warning on the
        ``accy_async`` logger and in a :class:`ResourceWarning`. Idempotent.
        """
        if self._health.closed:
            await anyio.lowlevel.checkpoint()
            return
        try:
            await self._drain()
        finally:
            self._health.close()
            deferred = self._registry.take_released()
            while deferred:  # popped, so nothing here keeps them referenced after
                self.destroy_all(deferred.pop())  # may drop an owned view's last reference
            while orphaned := self._registry.take_orphans():  # also those handed in meanwhile
                while orphaned:
                    objects, _ = orphaned.popleft()
                    self.destroy_all([obj for obj in objects if self.owns(obj)])
            leaked = self.live_handles()
            if leaked:
                owned = [obj for obj in leaked if not is_external(obj)]
                if owned:
                    message = (
                        f"accy-async: {len(owned)} objects were still alive when the "
                        f"{self.kind} backend closed (destroyed now): {owned[:8]!r}"
                    )
                    # Python hides ResourceWarning by default: the log says it where people look.
                    _logger.warning("%s", message)
                    warnings.warn(message, ResourceWarning, stacklevel=2)
                self.destroy_all(leaked)
            self._close()

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
