"""The backend contract: the :class:`Backend` base class and what every backend shares.

:class:`Backend` is what callers use: every public method checks its
arguments and the backend's :class:`~._health.Health`, keeps the books in a
:class:`~._registry.Registry`, then calls one of the primitives a backend
implements (:class:`~._primitives.BackendPrimitives`). The handles it gives
out live in :mod:`._handles`, what a waiter watches in :mod:`._marks`, the
bound launch in :mod:`._launcher`, what the device is in :mod:`._device_info`;
:mod:`accy_async.backends` exports them all.

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
import itertools
import logging
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel

from ..errors import (
    DeviceFault,
    InvalidArtifact,
    InvalidBuffer,
    LaunchArgumentMismatch,
    LimitExceeded,
    UnsupportedOperation,
)
from ..plan import ArtifactFormat, ArtifactSpec, DType, ScalarArgument
from ._completion import CompletionCallback, CompletionRegistration
from ._device_info import DeviceIdentity, Limits, WaitPolicy, check_wait_policy
from ._handles import (
    DEFAULT_ALIGNMENT,
    BufferBinding,
    BufferHandle,
    DeviceObject,
    EventHandle,
    KernelArtifact,
    LoadedArtifact,
    Ownership,
    StreamHandle,
    StreamLike,
    is_external,
    raw_handle_of,
    raw_stream_handle,
)
from ._health import Health
from ._launch_config import LaunchConfig
from ._launcher import StageLauncher
from ._marks import PendingRead, StreamMark
from ._primitives import BackendPrimitives
from ._registry import Registry
from .forecast import Anticipation

if TYPE_CHECKING:  # the trust model sits above the backends; they only hold a policy
    from ..trust import TrustPolicy

__all__ = ["Backend"]

_logger: Final = logging.getLogger("accy_async")

_backend_ids = itertools.count(1)


class Backend(BackendPrimitives):
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
        self.backend_id = next(_backend_ids)
        self.limits = limits or Limits()
        self.wait_policy = wait_policy
        self.trust_policy: TrustPolicy | None = None
        """CUDA kernels this backend may compile and load (``None``: whatever it is given).

        Set it before accepting plans from others: :meth:`create_artifact`
        then refuses any CUDA payload the policy does not list
        (:class:`~accy_async.errors.UntrustedKernel`). See :mod:`accy_async.trust`."""
        self._registry = Registry(self.backend_id)
        self._live = self._registry.live
        """The registry's live objects by id (the launch checks read it directly)."""
        self._health = Health(self.kind)

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
    @abc.abstractmethod
    def default_stream(self) -> StreamHandle:
        """The stream work goes to when none is given (not CUDA's legacy NULL stream)."""

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

    def live_objects(self, *, owned_only: bool = False) -> Mapping[int, str]:
        """Every object created and not yet destroyed: id to kind (``buffer``, ``event``...).

        With ``owned_only``, external buffers (memory the backend does not own) are left out.
        """
        return {obj.id: obj.kind for obj in self._registry.objects(owned_only=owned_only)}

    def live_handles(self, *, owned_only: bool = False) -> list[DeviceObject]:
        """The handles of :meth:`live_objects` (the default stream left out), to destroy them."""
        default = self.default_stream
        return [obj for obj in self._registry.objects(owned_only=owned_only) if obj is not default]

    def owns(self, obj: DeviceObject) -> bool:
        """Whether ``obj`` is a live object of this backend."""
        return self._registry.owns(obj)

    def check_bindings(self, bindings: Sequence[BufferBinding], path: str = "$") -> None:
        """Raise :class:`InvalidBuffer` unless each binding is a live buffer of this backend.

        Each must also lie inside its buffer; the error's path is ``path[index]``.
        """
        live = self._live
        for index, binding in enumerate(bindings):
            handle = binding.handle
            if live.get(handle.id) is not handle or handle.backend_id != self.backend_id:
                raise InvalidBuffer(
                    f"{handle!r} is not a live buffer of this backend", path=f"{path}[{index}]"
                )
            if binding.offset < 0 or binding.offset + binding.byte_size > handle.byte_size:
                raise InvalidBuffer(
                    f"{binding!r} is outside its buffer of {handle.byte_size} bytes",
                    path=f"{path}[{index}]",
                )

    def live_streams(self) -> list[StreamHandle]:
        """The default stream and every stream created and not destroyed."""
        streams = [self.default_stream]
        streams.extend(obj for obj in self._live.values() if isinstance(obj, StreamHandle))
        return streams

    # ----- buffers -------------------------------------------------------------------------

    def allocate_buffer(
        self,
        byte_size: int,
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        dtype: DType | None = None,
    ) -> BufferHandle:
        """A new buffer of ``byte_size`` bytes aligned to ``alignment`` (a power of two).

        Checked against :attr:`limits` before the device is asked.
        """
        self._check_usable()
        self.collect_deferred()
        if byte_size <= 0:
            raise InvalidBuffer(f"buffer size must be positive, got {byte_size}")
        if alignment <= 0 or alignment & (alignment - 1) or alignment > 4096:
            raise InvalidBuffer(f"alignment {alignment} is not a power of two up to 4096")
        if byte_size > self.limits.max_buffer_bytes:
            raise LimitExceeded(
                f"buffer of {byte_size} bytes exceeds the limit of "
                f"{self.limits.max_buffer_bytes} bytes per buffer"
            )
        held = self._registry.live_bytes
        if held + byte_size > self.limits.max_total_bytes:
            raise LimitExceeded(
                f"buffer of {byte_size} bytes would bring this backend to "
                f"{held + byte_size} bytes, over its limit of {self.limits.max_total_bytes}"
            )
        object_id = self._registry.new_id()
        native = self._allocate(object_id, byte_size, alignment)
        handle = BufferHandle(
            self.backend_id,
            object_id,
            native,
            byte_size,
            dtype=dtype,
            address=self._buffer_address(native),
        )
        self._registry.add(handle)
        return handle

    def write_buffer(
        self,
        buffer: BufferHandle,
        data: bytes | bytearray | memoryview,
        *,
        offset: int = 0,
        stream: StreamLike | None = None,
    ) -> None:
        """Enqueue a copy of ``data`` into ``buffer`` at ``offset``.

        The bytes are taken now, so ``data`` may change after the call; the copy
        lands in stream order.
        """
        self._check_usable()
        view = memoryview(data).cast("B")
        self._check_range(buffer, offset, view.nbytes)
        self._write(buffer, view, offset, self._stream(stream))

    def copy_buffer(
        self,
        source: BufferHandle,
        destination: BufferHandle,
        byte_size: int | None = None,
        *,
        source_offset: int = 0,
        destination_offset: int = 0,
        stream: StreamLike | None = None,
    ) -> None:
        """Enqueue a device-side copy of ``byte_size`` bytes (all of ``source`` by default).

        The ranges must lie inside their buffers, and must not overlap when
        both are one buffer (:class:`~accy_async.errors.InvalidBuffer`).
        """
        self._check_usable()
        size = source.byte_size - source_offset if byte_size is None else byte_size
        self._check_range(source, source_offset, size)
        self._check_range(destination, destination_offset, size)
        if (
            source is destination
            and source_offset < destination_offset + size
            and destination_offset < source_offset + size
        ):
            raise InvalidBuffer(
                f"copying {size} bytes within {source!r} from {source_offset} to "
                f"{destination_offset}: the ranges overlap"
            )
        if size:
            self._copy(
                source, source_offset, destination, destination_offset, size, self._stream(stream)
            )

    def enqueue_read(
        self,
        buffer: BufferHandle,
        *,
        offset: int = 0,
        byte_size: int | None = None,
        stream: StreamLike | None = None,
    ) -> PendingRead:
        """Enqueue a copy of ``buffer``'s bytes to the host; await it, then take ``result()``."""
        self._check_usable()
        size = buffer.byte_size - offset if byte_size is None else byte_size
        self._check_range(buffer, offset, size)
        return self._enqueue_read(buffer, offset, size, self._stream(stream))

    def fill_buffer(
        self, buffer: BufferHandle, pattern: int, *, stream: StreamLike | None = None
    ) -> None:
        """Enqueue filling ``buffer`` with the 32-bit ``pattern``, repeated.

        Raises :class:`~accy_async.errors.UnsupportedOperation` when the backend
        cannot fill this buffer (its size is not a multiple of 4, say).
        """
        self._check_usable()
        self._check_buffer(buffer)
        if not 0 <= pattern <= 0xFFFFFFFF:
            raise LaunchArgumentMismatch(f"fill pattern {pattern} is not a u32")
        self._fill(buffer, pattern, self._stream(stream))

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

    # ----- streams and events --------------------------------------------------------------

    def create_stream(self) -> StreamHandle:
        """A new stream, independent of the default one."""
        self._check_usable()
        object_id = self._registry.new_id()
        stream = StreamHandle(self.backend_id, object_id, self._create_stream(object_id))
        self._registry.add(stream)
        return stream

    def adopt_stream(self, stream: StreamLike) -> StreamHandle:
        """Another library's stream as a :class:`StreamHandle` of this backend, not owned.

        ``stream`` is anything :data:`StreamLike` names; a handle of this
        backend comes back as it is. The same raw stream gives the same handle
        each time, so its forecast carries over. The backend never destroys
        the stream itself (destroying the handle only forgets it) and closing
        the backend does not warn about it. Every function that takes a
        stream adopts it this way, so ``stream=torch.cuda.current_stream()``
        works anywhere. Raises :class:`InvalidBuffer` for something that is
        not a stream or is another device's, and
        :class:`~accy_async.errors.UnsupportedOperation` on backends without
        CUDA streams (the CPU backend).
        """
        if type(stream) is StreamHandle:
            return self._stream(stream)
        self._check_usable()
        raw = raw_stream_handle(stream)
        adopted = self._registry.adopted
        known = adopted.get(raw)
        if known is not None:
            return known
        for ours in self.live_streams():  # one of ours, by its raw handle: not an alias
            if not ours.external and raw_handle_of(ours) == raw:
                adopted[raw] = ours
                return ours
        object_id = self._registry.new_id()
        handle = StreamHandle(
            self.backend_id, object_id, self._adopt_stream(object_id, raw), external=True
        )
        self._registry.add(handle)
        adopted[raw] = handle
        return handle

    def create_event(self, *, timing: bool = False) -> EventHandle:
        """A new event. Never recorded, it counts as complete.

        Dependency events keep timing off (it is cheaper on CUDA); ``timing``
        events can be given to :meth:`elapsed_seconds`.
        """
        self._check_usable()
        object_id = self._registry.new_id()
        native = self._create_event(object_id, timing)
        event = EventHandle(self.backend_id, object_id, native, timing=timing)
        self._registry.add(event)
        return event

    def elapsed_seconds(self, start: EventHandle, end: EventHandle) -> float:
        """Device time between the completion of ``start``'s and ``end``'s latest records.

        Both must be live timing events (``create_event(timing=True)``) whose
        records have completed, else :class:`UnsupportedOperation`. On the CPU
        backend this is the wall-clock time between the two records running on
        their streams' worker threads.
        """
        self._check_usable()
        for event in (start, end):
            self._check_live(event)
            if not event.timing:
                raise UnsupportedOperation(f"{event!r} was created without timing")
            if not self._query_event(event):
                raise UnsupportedOperation(f"{event!r} has not completed")
        return self._elapsed(start, end)

    def record_event(self, event: EventHandle, stream: StreamLike | None = None) -> None:
        """Record ``event`` on ``stream``: it completes when the work enqueued before has."""
        self._check_usable()
        self._check_live(event)
        self._record(event, self._stream(stream))

    def wait_event(self, stream: StreamLike | None, event: EventHandle) -> None:
        """Make ``stream`` wait, on the device, for ``event``'s latest record."""
        self._check_usable()
        self._check_live(event)
        self._wait(self._stream(stream), event)

    def follow_foreign_stream(self, stream: StreamLike | None, foreign: StreamLike) -> None:
        """Make ``stream`` wait, on the device, for the work queued so far on ``foreign``.

        ``foreign`` is a stream this backend does not own (another library's:
        PyTorch's, CuPy's, as an object or a raw handle; 1 and 2 are CUDA's
        legacy and per-thread default streams). Nothing waits on the host. Only backends with such
        streams (CUDA) support it.
        """
        self._check_usable()
        self._follow_foreign(self._stream(stream), raw_stream_handle(foreign))

    def lead_foreign_stream(self, foreign: StreamLike, stream: StreamLike | None) -> None:
        """Make the raw stream ``foreign`` wait, on the device, for the work queued on ``stream``.

        See :meth:`follow_foreign_stream`.
        """
        self._check_usable()
        self._lead_foreign(raw_stream_handle(foreign), self._stream(stream))

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
        self._launch(
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
        self._launch(
            loaded,
            buffers,
            scalars,
            config,
            self.default_stream if stream is None else stream,
            wait_events,
            signal_event,
            diagnostic_id,
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

    # ----- destruction ---------------------------------------------------------------------

    def destroy(self, obj: DeviceObject) -> None:
        """Destroy a buffer, loaded artifact, stream or event, exactly once.

        The device must no longer use it: destroy after the work queued on it
        has completed, or use :meth:`defer_destroy`. External buffers are only
        forgotten. Destroying is allowed after a fault and after close.
        """
        if obj is self.default_stream:
            raise InvalidBuffer("the default stream cannot be destroyed")
        self._registry.remove(obj)
        if isinstance(obj, BufferHandle) and obj.ownership is Ownership.EXTERNAL:
            return
        if isinstance(obj, StreamHandle):
            raw = raw_handle_of(obj)
            adopted = self._registry.adopted
            if raw is not None and adopted.get(raw) is obj:
                del adopted[raw]
            if obj.external:
                self._forget_stream(obj)
                return
        self._destroy(obj)

    def destroy_all(self, objects: Iterable[DeviceObject]) -> None:
        """Destroy each object; a failure becomes a :class:`ResourceWarning` and the rest go on."""
        for obj in objects:
            try:
                self.destroy(obj)
            except Exception as exc:  # noqa: BLE001 - clean-up must go on
                warnings.warn(
                    f"accy-async: failed to destroy {obj!r}: {exc}", ResourceWarning, stacklevel=2
                )

    def defer_destroy(
        self,
        objects: Sequence[DeviceObject],
        after: StreamLike | Sequence[StreamLike | None] | None = None,
    ) -> None:
        """Destroy ``objects`` once the work now queued on the ``after`` stream(s) completes.

        For clean-up that must not wait (a cancelled or timed-out wait): the
        objects stay alive until the device is done with them, and are
        destroyed by a later call on this backend or at :meth:`aclose`.
        """
        if not objects:
            return
        if self._health.refusal is not None:
            self.destroy_all(objects)
            return
        streams = [self._stream(s) for s in (after if isinstance(after, Sequence) else [after])]
        on_complete = self._registry.defer(objects, len(streams))
        for stream in streams:
            self._notify_when_stream_complete(stream, on_complete)
        self.collect_deferred()  # streams that were idle already

    def release_from_any_thread(
        self, objects: Sequence[DeviceObject], after: StreamHandle | None = None
    ) -> None:
        """:meth:`defer_destroy` for code that may run on any thread (a finalizer).

        Nothing is destroyed or enqueued here: the objects are handed to the
        next call on this backend that collects deferred releases (a launch,
        an allocation, :meth:`aclose`), which defers them after ``after``
        (the default stream if ``after`` is gone by then).
        """
        self._registry.orphan(objects, after)

    def collect_deferred(self) -> None:
        """Destroy the deferred objects whose work has completed."""
        registry = self._registry
        if not registry.ready:
            return
        orphans_wait, tokens = registry.take_ready()
        if orphans_wait:
            orphaned = registry.take_orphans()
            while orphaned:
                objects, stream = orphaned.pop()
                live = [obj for obj in objects if self.owns(obj)]
                self.defer_destroy(live, after=stream if stream and self.owns(stream) else None)
        done = registry.take_released(tokens)
        while done:  # popped, so nothing here keeps them referenced after
            self.destroy_all(done.pop())

    @property
    def deferred_count(self) -> int:
        """How many objects wait in deferred releases."""
        return self._registry.deferred_count

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
            orphaned = self._registry.take_orphans()
            while orphaned:
                objects, _ = orphaned.pop()
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

    # ----- helpers for subclasses ----------------------------------------------------------

    def register_external_buffer(self, native: Any, byte_size: int) -> BufferHandle:
        """Track memory this backend does not own as a buffer; destroying it only forgets it."""
        self._check_usable()
        handle = BufferHandle(
            self.backend_id,
            self._registry.new_id(),
            native,
            byte_size,
            ownership=Ownership.EXTERNAL,
            address=self._buffer_address(native) if native is not None else 0,
        )
        self._registry.add(handle)
        return handle

    def poison(self, fault: DeviceFault) -> None:
        """Record a sticky fault: every later call raises it, every waiter fails with it."""
        if self._health.poison(fault):
            self._on_poisoned(fault)

    def _check_usable(self) -> None:
        if self._health.refusal is not None:
            self._health.refuse()

    def _stream(self, stream: StreamLike | None) -> StreamHandle:
        if stream is None:
            return self.default_stream
        if type(stream) is not StreamHandle:
            return self.adopt_stream(stream)
        if self._live.get(stream.id) is not stream and stream is not self.default_stream:
            raise InvalidBuffer(f"{stream!r} is not a live stream of this backend")
        return stream

    def _check_live(self, obj: DeviceObject) -> None:
        if not self.owns(obj):
            raise InvalidBuffer(f"{obj!r} is not a live {obj.kind} of this backend")

    def _check_buffer(self, buffer: BufferHandle) -> None:
        self._check_live(buffer)

    def _check_range(self, buffer: BufferHandle, offset: int, size: int) -> None:
        self._check_buffer(buffer)
        if offset < 0 or size < 0 or offset + size > buffer.byte_size:
            raise InvalidBuffer(
                f"range [{offset}:{offset + size}] is outside {buffer!r} "
                f"of {buffer.byte_size} bytes"
            )
