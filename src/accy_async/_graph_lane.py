"""A lane of the graph call on one device: its streams, slot buffers and count buffers, reused.

:class:`~accy_async.graph_call.GraphCall` runs each call on a free set of
lanes, one per device the graph runs on. A lane keeps what its calls need
between them: a stream (and the graph's own streams, where it names some), a
buffer per slot used on its device sized for the largest call seen, and the
u32 count buffers of the kernels that take one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .arrays import ArrayView
from .backends import Backend, BufferBinding, BufferHandle, DeviceObject, StreamHandle
from .buffers import copy_between, download
from .kernels import ElementCountBufferBinding
from .plan import ArtifactPlan
from .waiting import release_when_idle, wait_stream

__all__ = ["GraphLane"]


@dataclass(eq=False)
class GraphLane:
    """One device's part of a graph call: see the module docstring."""

    backend: Backend
    stream: StreamHandle
    graph_streams: list[StreamHandle] = field(default_factory=list)
    buffers: dict[int, BufferHandle] = field(default_factory=dict)
    counts: list[BufferHandle] = field(default_factory=list)
    count_bindings: dict[int, ElementCountBufferBinding] = field(default_factory=dict)
    """The u32 count buffer of each kernel that takes one, by kernel id."""

    @classmethod
    def open(cls, backend: Backend, plan: ArtifactPlan, stream_count: int) -> GraphLane:
        """A new lane: its streams, and a count buffer (holding the plan's count) per kernel."""
        lane = cls(backend, backend.create_stream())
        try:
            lane.graph_streams.extend(backend.create_stream() for _ in range(stream_count))
            for kernel in plan.kernels:
                if kernel.element_count_argument != "device_buffer_u32":
                    continue
                count = backend.allocate_buffer(4)
                lane.counts.append(count)
                value = np.array([kernel.element_count_argument_value], np.uint32)
                backend.write_buffer(count, value.data, stream=lane.stream)
                lane.count_bindings[kernel.kernel_id] = ElementCountBufferBinding(
                    kernel.kernel_id, count.bind("read_only")
                )
        except BaseException:
            backend.destroy_all(lane.objects())
            raise
        return lane

    @property
    def streams(self) -> list[StreamHandle]:
        """Every stream of the lane, its own first."""
        return [self.stream, *self.graph_streams]

    def objects(self) -> list[DeviceObject]:
        """Everything the lane made, streams last."""
        return [*self.buffers.values(), *self.counts, *self.graph_streams, self.stream]

    async def release(self) -> None:
        """Destroy the lane once its streams are idle (later, if the caller is cancelled)."""
        await release_when_idle(self.backend, self.objects(), self.streams)

    def bind(self, sizes: Mapping[int, int]) -> dict[int, BufferBinding]:
        """A binding of ``sizes[slot]`` bytes for each slot, growing buffers a call outgrew."""
        backend = self.backend
        bindings: dict[int, BufferBinding] = {}
        for slot_id, size in sizes.items():
            buffer = self.buffers.get(slot_id)
            if buffer is None or buffer.byte_size < size:
                if buffer is not None:
                    del self.buffers[slot_id]
                    backend.defer_destroy([buffer], after=self.streams)
                buffer = self.buffers[slot_id] = backend.allocate_buffer(size)
            bindings[slot_id] = BufferBinding(buffer, byte_size=size)
        return bindings

    async def put(self, bindings: Mapping[int, BufferBinding], given: Mapping[int, Any]) -> None:
        """Enqueue on the lane's stream each slot's start: its array, else zeros.

        An array is NumPy (written) or an :class:`~accy_async.arrays.ArrayView`
        (copied on the device from its backend, after the work on its stream).
        """
        backend = self.backend
        for slot_id, binding in bindings.items():
            value = given.get(slot_id)
            if value is None:
                if binding.byte_size % 4 == 0:
                    backend.fill_buffer(binding.handle, 0, stream=self.stream)
                else:
                    zeros = bytes(binding.byte_size)
                    backend.write_buffer(binding.handle, zeros, stream=self.stream)
            elif isinstance(value, ArrayView):
                await self._copy_in(value, binding)
            else:
                data = value.view(np.uint8).data
                backend.write_buffer(binding.handle, data, stream=self.stream)

    async def _copy_in(self, view: ArrayView, binding: BufferBinding) -> None:
        backend = self.backend
        if view.backend is backend:
            after = view.live_stream
            if after is not None and after is not self.stream:
                backend.follow_peer_stream(self.stream, backend, after)
            backend.copy_buffer(view.buffer, binding.handle, view.nbytes, stream=self.stream)
            return
        await copy_between(
            view.backend,
            view.buffer,
            backend,
            binding.handle,
            view.nbytes,
            after=view.live_stream,
            stream=self.stream,
        )

    async def take(self, binding: BufferBinding, dtype: np.dtype[Any], device: bool) -> Any:
        """The slot's elements once the lane's stream has run.

        NumPy, or with ``device`` a copy in a new
        :class:`~accy_async.arrays.ArrayView` where the backend is not the CPU.
        """
        backend = self.backend
        count = binding.byte_size // dtype.itemsize
        if not device or backend.kind == "cpu":
            return await download(backend, binding.handle, dtype, count, stream=self.stream)
        view = ArrayView.allocate(backend, dtype, count)
        view.stream = self.stream  # dropped before the copy ran: freed after it
        backend.copy_buffer(binding.handle, view.buffer, view.nbytes, stream=self.stream)
        await wait_stream(backend, self.stream)  # the lane's next call may overwrite the slot
        view.stream = None  # written: the lane's stream is not the view's to follow
        return view
