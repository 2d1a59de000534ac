"""A lane of the high-level call: one call's stream, scratch and device copies, reused.

:class:`~accy_async.call.PipelineCall` runs each call on a free lane (up to
its ``max_lanes`` at once). A lane keeps what its calls need between them: a
stream, the scratch sized for the largest request seen, device copies of the
arrays off the CPU, and what earlier calls still hold until the device is done.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Final

from ._call_replay import Replay
from .backends import (
    Access,
    Backend,
    BufferBinding,
    BufferHandle,
    EventHandle,
    Ownership,
    StreamHandle,
)
from .errors import AccyError
from .interop import Lease
from .pipeline import PipelineIntermediates, Resolution, allocate_pipeline_intermediates
from .plan import KernelCallPipeline

__all__ = ["Lane"]

_HELD_AT_MOST: Final = 64
"""Arrays and buffers a lane holds past their calls (released in one go) before it
hands them on."""

_EXTERNAL_KEPT: Final = 64
"""Bindings of callers' memory a lane remembers (all forgotten at once past this)."""

_QUERY_FROM: Final = 8
"""Held things below which a call does not ask whether the lane's last call is done."""


@dataclass(eq=False)
class Lane:
    """One call's stream, scratch and (off the CPU) device copies of the arrays.

    A call runs on the lane's ``stream``, or on the caller's stream (see
    :meth:`~accy_async.call.PipelineCall.__call__`); ``where`` is the stream of the lane's
    last call and ``done`` an event recorded after it. A call on another
    stream than the last waits for ``done`` on the device (the scratch is
    shared); nothing keeps a caller's stream once its call has returned.
    ``owners`` are the callers' arrays of earlier calls (kept referenced so no
    library frees or reuses their memory under the device) and ``held`` the
    device copies the lane outgrew: both go when a later call finds ``done``
    complete (one query, asked once a few are held), or, past
    :data:`_HELD_AT_MOST`, once the backend sees the lane idle. No call pays
    for a completion watch of its own, nor registers the arrays with the backend.
    """

    stream: StreamHandle
    done: EventHandle | None = None
    scratch: PipelineIntermediates | None = None
    buffers: dict[tuple[str, int], BufferHandle] = field(default_factory=dict)
    held: list[BufferHandle] = field(default_factory=list)
    owners: list[Any] = field(default_factory=list)
    where: StreamHandle | None = None
    external: dict[tuple[int, int, Access], BufferBinding] = field(default_factory=dict)
    replays: dict[tuple[object, ...], Replay | None] = field(default_factory=dict)
    """Calls launched on this lane, by :func:`~accy_async._call_replay.replay_key`: ``None``
    once seen, a :class:`Replay` once seen twice (packing costs more than a launch)."""

    def objects(self, backend: Backend) -> list[Any]:
        """What the lane owns but its stream, the held arrays as one object to release."""
        scratch = [] if self.scratch is None else [b.handle for b in self.scratch]
        if self.scratch is not None:
            self.scratch.closed = True  # its buffers are released with the lane's
        held, self.held = self.held, []
        done = [] if self.done is None else [self.done]
        return [*scratch, *self.buffers.values(), *held, *self._owners_held(backend), *done]

    def _owners_held(self, backend: Backend) -> list[BufferHandle]:
        """The owners, handed to the backend as one external buffer (released = let go)."""
        owners, self.owners = self.owners, []
        if not owners:
            return []
        return [backend.register_external_buffer(Lease(0, owners), 0)]

    def follow(self, backend: Backend, stream: StreamHandle) -> None:
        """Before a call on ``stream``: wait (on the device) for the lane's last call elsewhere."""
        if self.where is not None and self.where is not stream and self.done is not None:
            backend.wait_event(stream, self.done)

    def ran(self, backend: Backend, stream: StreamHandle) -> None:
        """After a call's enqueue on ``stream``: mark where the lane's work now ends."""
        if self.done is None:
            self.done = backend.create_event()
        backend.record_event(self.done, stream)
        self.where = stream

    def settle(self, backend: Backend) -> None:
        """Make the lane's own stream wait for its last call, so waiting for it covers all."""
        if self.where is not None and self.where is not self.stream:
            with contextlib.suppress(AccyError):  # a dead backend: nothing runs any more
                self.follow(backend, self.stream)
            self.where = self.stream

    def release_held(self, backend: Backend, *, all_now: bool = False) -> None:
        """Let go of what earlier calls held if their work is done (or hand it on, if much).

        With ``all_now`` everything goes, whatever the count: now if the last
        call is done, else once it is (for a caller that dropped arrays it
        passed and wants their memory back without waiting for later calls).
        """
        count = len(self.held) + len(self.owners)
        if not count or (not all_now and not self.held and count < _QUERY_FROM):
            return  # a few arrays: no need to ask yet
        if self.done is None or backend.query_event(self.done):
            held, self.held = self.held, []
            self.owners = []
            backend.destroy_all(held)
        elif all_now or count >= _HELD_AT_MOST:
            self.settle(backend)
            held, self.held = self.held, []
            backend.defer_destroy([*held, *self._owners_held(backend)], after=self.stream)

    async def fit(
        self, backend: Backend, pipeline: KernelCallPipeline, resolution: Resolution
    ) -> None:
        """Grow the scratch to fit the scalars ``resolution`` was made for."""
        needed = resolution.intermediate_sizes
        scratch = self.scratch
        if needed and (
            scratch is None
            or any(b.byte_size < size for b, size in zip(scratch, needed, strict=True))
        ):
            self.scratch = None
            self.replays.clear()  # their stages were packed with the old scratch
            if scratch is not None:
                self.settle(backend)  # the scratch may be in use on a caller's stream
                await scratch.aclose()
            self.scratch = await allocate_pipeline_intermediates(
                backend, pipeline, resolution.arguments
            )

    def external_binding(
        self, backend: Backend, address: int, byte_size: int, access: Access
    ) -> BufferBinding:
        """A binding of ``byte_size`` bytes of a caller's device memory at ``address``.

        Not registered with the backend (the call checked the array, and the lane
        keeps its owner referenced until the work is done); a binding only
        describes the memory, so the next call on the same memory reuses it.
        """
        key = (address, byte_size, access)
        binding = self.external.get(key)
        if binding is None:
            if len(self.external) >= _EXTERNAL_KEPT:
                self.external.clear()
            handle = BufferHandle(
                backend.backend_id,
                0,
                None,
                byte_size,
                ownership=Ownership.EXTERNAL,
                address=address,
            )
            binding = self.external[key] = handle.bind(access, byte_size=byte_size)
        return binding

    def device_buffer(self, backend: Backend, key: tuple[str, int], byte_size: int) -> BufferHandle:
        """The device buffer ``key``, grown to ``byte_size`` (off the CPU).

        The old one is held until the lane's earlier calls are done (see :class:`Lane`).
        """
        buffer = self.buffers.get(key)
        if buffer is None or buffer.byte_size < byte_size:
            if buffer is not None:
                del self.buffers[key]
                self.held.append(buffer)
            buffer = self.buffers[key] = backend.allocate_buffer(max(byte_size, 1))
        return buffer
