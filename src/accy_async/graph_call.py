"""Arrays in, arrays out for launch graphs: a launch-graph document as an awaitable function.

::

    async with accy.open_graph(document, backend=backend) as run:
        out = await run({1: x})            # {slot id: NumPy array} for each slot read back

The graph call is to :func:`~accy_async.graph.launch_graph` what
:func:`~accy_async.open_pipeline` is to ``launch_pipeline``. A
:class:`~accy_async.plan.LaunchGraphDocument` names slots, not operands: the
caller gives arrays for the slots it fills (``{slot_id: array}``), the call
gives every other slot a buffer of the plan's ``byte_size`` (scratch, and the
slots the kernels write), runs the document's graph (its dataflow graph when
it has none) and reads back the slots asked for (by default each kernel's
output slot), as NumPy arrays of the slot's dtype.

The kernels are loaded once and each call runs on a lane: a stream, the slots'
buffers sized for the largest call seen and reused, and the u32 count buffers
of the kernels that take one. Concurrent calls get their own lane (up to
``max_lanes`` at once, the rest wait). Each call starts from zeros in every
slot it gives no array (on the device, before its first kernel), so a call's
results never depend on which lane ran it or what ran there before.

Everything is checked before anything is allocated or enqueued: each slot
named is the plan's, each array's dtype and size fit its slot, each slot
without an array has a size. A cancelled call returns at once; its lane's
buffers are released once the device is done with them.

A slot may also be given an :class:`~accy_async.arrays.ArrayView` of the
same backend (a result kept in device memory): it is copied on the device.
With ``device=True`` the slots read come back as new
:class:`~accy_async.arrays.ArrayView` arrays instead of NumPy (on the CPU
backend they are NumPy either way: its device memory is the host's).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, SupportsIndex

import anyio
import numpy as np

from ._graph_schedule import schedule_of
from ._loops import checkpoint
from .arrays import ArrayView
from .backends import Backend, BufferBinding, BufferHandle, DeviceObject, StreamHandle
from .buffers import download
from .errors import LaunchArgumentMismatch, UnsupportedOperation
from .graph import launch_all, launch_graph
from .kernels import ElementCountBufferBinding, LaunchOptions, LoadedKernels, load_kernels
from .plan import LaunchGraphDocument, Slot
from .waiting import release_when_idle, wait_stream

__all__ = ["DEFAULT_GRAPH_LANES", "GraphCall", "open_graph"]

DEFAULT_GRAPH_LANES: Final = 4
"""Calls that may run at once on one :class:`GraphCall` by default."""

GraphArrays = dict[int, Any]
"""What a graph call returns: ``{slot_id: array}`` for each slot read back."""

_CLOSED_BEFORE: Final = "the graph call was closed before this one ran"


def open_graph(
    document: LaunchGraphDocument,
    *,
    backend: Backend,
    max_lanes: int = DEFAULT_GRAPH_LANES,
    device_graph: bool | None = None,
) -> GraphCall:
    """The launch graph of ``document`` as an awaitable function; see the module docstring.

    Use it as ``async with``: entering checks the graph against its plan
    and loads the kernels, leaving waits for the calls in flight and frees
    everything. ``device_graph`` is :func:`~accy_async.graph.launch_graph`'s
    (``None``: a graph run before goes to the device as one graph where it
    can). A graph that waits for or signals the caller's events cannot be
    called this way (:class:`~accy_async.errors.UnsupportedOperation` on
    entering), nor one ``device_graph=True`` cannot make one device graph.
    """
    if max_lanes < 1:
        raise ValueError(f"max_lanes must be at least 1, not {max_lanes}")
    return GraphCall(document, backend, max_lanes, device_graph)


@dataclass(eq=False)
class _Lane:
    """One call's streams and slot buffers, kept between calls."""

    stream: StreamHandle
    graph_streams: list[StreamHandle]
    buffers: dict[int, BufferHandle] = field(default_factory=dict)
    counts: list[BufferHandle] = field(default_factory=list)
    count_bindings: list[ElementCountBufferBinding] = field(default_factory=list)

    def objects(self) -> list[DeviceObject]:
        return [*self.buffers.values(), *self.counts, *self.graph_streams, self.stream]

    @property
    def streams(self) -> list[StreamHandle]:
        return [self.stream, *self.graph_streams]


@dataclass(frozen=True, slots=True)
class _Request:
    """One call's checked arrays: what goes into each slot, and what is read back."""

    given: dict[int, Any]
    sizes: dict[int, int]
    """Each slot's bytes for this call."""
    read: tuple[int, ...]
    dtypes: dict[int, np.dtype[Any]]
    """The dtype each slot read back comes as."""


class GraphCall:
    """A loaded launch graph, called with arrays; see :func:`open_graph`."""

    def __init__(
        self,
        document: LaunchGraphDocument,
        backend: Backend,
        max_lanes: int,
        device_graph: bool | None,
    ) -> None:
        self.document = document
        self.backend = backend
        self._device_graph = device_graph
        self._kernels: LoadedKernels | None = None
        self._free: list[_Lane] = []
        self._slots = anyio.Semaphore(max_lanes)
        self._max_lanes = max_lanes
        self._closed = False
        plan = document.artifact_plan
        self._plan_slots: dict[int, Slot] = {slot.slot_id: slot for slot in plan.slots}
        self._default_read = tuple(dict.fromkeys(k.output_slot_id for k in plan.kernels))
        self._stream_count = document.graph.stream_count if document.graph is not None else 0

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def _closed_now(self) -> bool:
        """:attr:`closed`, read again after an await (a call, so type checkers do not narrow)."""
        return self._closed

    async def __aenter__(self) -> GraphCall:
        graph = self.document.graph
        if graph is not None:
            schedule = schedule_of(graph, self.document.artifact_plan)  # checked against the plan
            if graph.event_count:
                raise UnsupportedOperation(
                    f"the graph uses {graph.event_count} of the caller's events: a graph call "
                    "binds none (use launch_graph)",
                    path="$.graph.event_count",
                )
            if self._device_graph is True and schedule.graph_refusal is not None:
                raise UnsupportedOperation(
                    f"this graph cannot be one device graph: {schedule.graph_refusal}",
                    path="$.graph",
                )
        self._kernels = await load_kernels(self.backend, self.document.artifact_plan)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Wait for the calls in flight, then free the lanes and unload the kernels.

        Calls still waiting for a lane are refused
        (:class:`~accy_async.errors.LaunchArgumentMismatch`). Cancelled, it
        returns at once; what the device still uses is released once it is
        done.
        """
        if self._closed:
            await checkpoint()
            return
        self._closed = True
        taken = 0
        try:
            for _ in range(self._max_lanes):  # every lane back: no call is in flight
                await self._slots.acquire()
                taken += 1
        finally:
            await self._release_all()
            for _ in range(taken):
                self._slots.release()

    async def _release_all(self) -> None:
        lanes, self._free = self._free, []
        kernels, self._kernels = self._kernels, None
        objects = [each for lane in lanes for each in lane.objects()]
        streams = [each for lane in lanes for each in lane.streams]
        try:
            if kernels is not None:
                await kernels.aclose()
        finally:
            await release_when_idle(self.backend, objects, streams)

    async def __call__(
        self,
        inputs: Mapping[Any, Any] | None = None,
        *,
        read: Iterable[SupportsIndex] | None = None,
        device: bool = False,
    ) -> GraphArrays:
        """Run the graph with ``inputs`` (``{slot_id: array}``); the slots ``read``, as arrays.

        ``read`` defaults to each kernel's output slot, in the plan's order.
        Raises :class:`~accy_async.errors.LaunchArgumentMismatch` (naming the
        slot) for a slot that is not the plan's, an array whose dtype or size
        does not fit its slot, or a slot with no array and no ``byte_size``;
        nothing has run then.
        """
        await checkpoint()
        kernels = self._kernels
        if kernels is None or self._closed:
            raise LaunchArgumentMismatch(
                "the graph call is not open (use it as 'async with open_graph(...)')"
            )
        request = self._check(dict(inputs or {}), read)
        async with self._slots:
            if self._closed_now():
                raise LaunchArgumentMismatch(_CLOSED_BEFORE)
            lane = self._free.pop() if self._free else self._new_lane(kernels)
            try:
                results = await self._run(kernels, lane, request, device)
            except BaseException:
                # The device may still use the lane: it goes once its streams are idle.
                await release_when_idle(self.backend, lane.objects(), lane.streams)
                raise
            self._free.append(lane)  # a close waits for this call to give its lane back
            return results

    # ----- checks ---------------------------------------------------------------------------

    def _check(self, inputs: dict[Any, Any], read: Iterable[SupportsIndex] | None) -> _Request:
        given: dict[int, Any] = {}
        sizes: dict[int, int] = {}
        dtypes: dict[int, np.dtype[Any]] = {}
        for key, array in inputs.items():
            slot = self._slot(key, f"$.inputs[{key!r}]")
            slot_id = slot.slot_id
            given[slot_id], sizes[slot_id] = self._checked_array(slot, array)
            dtypes[slot_id] = np.dtype(given[slot_id].dtype)
        for slot_id, slot in self._plan_slots.items():
            if slot_id in sizes:
                continue
            if slot.byte_size is None:
                raise LaunchArgumentMismatch(
                    f"slot {slot_id} has no byte_size in the plan: pass an array for it",
                    path=f"$.inputs[{slot_id}]",
                )
            sizes[slot_id] = slot.byte_size
        if read is None:
            read_ids = self._default_read
        elif isinstance(read, str | bytes) or not isinstance(read, Iterable):
            raise LaunchArgumentMismatch(
                f"read takes slot ids (a list of ints), not {type(read).__name__}", path="$.read"
            )
        else:
            read_ids = tuple(dict.fromkeys(self._slot(each, "$.read").slot_id for each in read))
        for slot_id in read_ids:
            slot = self._slot(slot_id, "$.read")
            dtype = dtypes.get(slot_id) or np.dtype(
                slot.dtype.numpy_name if slot.dtype is not None else np.uint8
            )
            if sizes[slot_id] % dtype.itemsize:
                raise LaunchArgumentMismatch(
                    f"slot {slot_id} holds {sizes[slot_id]} bytes, not a whole number of {dtype}",
                    path="$.read",
                )
            dtypes[slot_id] = dtype
        return _Request(given, sizes, read_ids, dtypes)

    def _slot(self, slot_id: Any, path: str) -> Slot:
        slot = None
        if not isinstance(slot_id, bool | str | bytes):
            try:
                slot = self._plan_slots.get(operator.index(slot_id))
            except TypeError:
                slot = None
        if slot is None:
            raise LaunchArgumentMismatch(f"{slot_id!r} is not a slot of the plan", path=path)
        return slot

    def _checked_array(self, slot: Slot, array: Any) -> tuple[Any, int]:
        """``array`` as the call binds it (a contiguous NumPy array or a view), and its bytes."""
        path = f"$.inputs[{slot.slot_id}]"
        if isinstance(array, ArrayView):
            if array.backend is not self.backend or not self.backend.owns(array.buffer):
                raise LaunchArgumentMismatch(
                    f"slot {slot.slot_id}: the array is not a live array of this backend",
                    path=path,
                )
            value: Any = array
        elif isinstance(array, np.ndarray):
            if not array.flags.c_contiguous:
                raise LaunchArgumentMismatch(
                    f"slot {slot.slot_id}: the array is not contiguous", path=path
                )
            value = array.reshape(-1)
        else:
            raise LaunchArgumentMismatch(
                f"slot {slot.slot_id}: expected a NumPy array, got {type(array).__name__}",
                path=path,
            )
        if slot.dtype is not None and np.dtype(value.dtype) != np.dtype(slot.dtype.numpy_name):
            raise LaunchArgumentMismatch(
                f"slot {slot.slot_id} holds {slot.dtype.value}, the array is {value.dtype}",
                path=path,
            )
        nbytes = int(value.nbytes)
        if slot.byte_size is not None and nbytes != slot.byte_size:
            raise LaunchArgumentMismatch(
                f"slot {slot.slot_id} holds {slot.byte_size} bytes, the array {nbytes}",
                path=path,
            )
        if nbytes == 0:
            raise LaunchArgumentMismatch(f"slot {slot.slot_id}: the array is empty", path=path)
        return value, nbytes

    # ----- running --------------------------------------------------------------------------

    def _new_lane(self, kernels: LoadedKernels) -> _Lane:
        backend = self.backend
        lane = _Lane(backend.create_stream(), [])
        try:
            lane.graph_streams.extend(backend.create_stream() for _ in range(self._stream_count))
            for kernel in kernels.artifact_plan.kernels:
                if kernel.element_count_argument != "device_buffer_u32":
                    continue
                count = backend.allocate_buffer(4)
                lane.counts.append(count)
                value = np.array([kernel.element_count_argument_value], np.uint32)
                backend.write_buffer(count, value.data, stream=lane.stream)
                lane.count_bindings.append(
                    ElementCountBufferBinding(kernel.kernel_id, count.bind("read_only"))
                )
        except BaseException:
            backend.destroy_all(lane.objects())
            raise
        return lane

    def _bindings(self, lane: _Lane, request: _Request) -> dict[int, BufferBinding]:
        """Each slot's buffer for this call, grown where a call needs more than the lane has."""
        backend = self.backend
        bindings: dict[int, BufferBinding] = {}
        for slot_id, size in request.sizes.items():
            buffer = lane.buffers.get(slot_id)
            if buffer is None or buffer.byte_size < size:
                if buffer is not None:
                    del lane.buffers[slot_id]
                    backend.defer_destroy([buffer], after=lane.streams)
                buffer = lane.buffers[slot_id] = backend.allocate_buffer(size)
            bindings[slot_id] = BufferBinding(buffer, byte_size=size)
        return bindings

    async def _run(
        self, kernels: LoadedKernels, lane: _Lane, request: _Request, device: bool
    ) -> GraphArrays:
        backend = self.backend
        bindings = self._bindings(lane, request)
        for slot_id, binding in bindings.items():
            value = request.given.get(slot_id)
            if value is None:
                if binding.byte_size % 4 == 0:
                    backend.fill_buffer(binding.handle, 0, stream=lane.stream)
                else:
                    backend.write_buffer(
                        binding.handle, bytes(binding.byte_size), stream=lane.stream
                    )
            elif isinstance(value, ArrayView):
                if value.live_stream is not None and value.live_stream is not lane.stream:
                    await wait_stream(backend, value.live_stream)
                backend.copy_buffer(value.buffer, binding.handle, value.nbytes, stream=lane.stream)
            else:
                backend.write_buffer(binding.handle, value.view(np.uint8).data, stream=lane.stream)
        graph = self.document.graph
        if graph is None:
            run = await launch_all(
                kernels, bindings, lane.count_bindings, LaunchOptions(stream=lane.stream)
            )
        else:
            if lane.graph_streams:  # the graph's own streams start after the writes land
                await wait_stream(backend, lane.stream)
            run = await launch_graph(
                kernels,
                bindings,
                graph,
                lane.count_bindings,
                streams=lane.graph_streams,
                default_stream=lane.stream,
                device_graph=self._device_graph,
            )
        await run.wait()
        return {
            slot_id: await self._result(lane, bindings[slot_id], request.dtypes[slot_id], device)
            for slot_id in request.read
        }

    async def _result(
        self, lane: _Lane, binding: BufferBinding, dtype: np.dtype[Any], device: bool
    ) -> Any:
        backend = self.backend
        count = binding.byte_size // dtype.itemsize
        if not device or backend.kind == "cpu":
            return await download(backend, binding.handle, dtype, count, stream=lane.stream)
        view = ArrayView.allocate(backend, dtype, count)
        view.stream = lane.stream  # dropped before the copy ran: freed after it
        backend.copy_buffer(binding.handle, view.buffer, view.nbytes, stream=lane.stream)
        await wait_stream(backend, lane.stream)  # the lane's next call may overwrite the slot
        view.stream = None  # written: the lane's stream is not the view's to follow
        return view
