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

A slot may also be given an :class:`~accy_async.arrays.ArrayView` of one of
the call's backends (a result kept in device memory): it is copied on the
device. With ``device=True`` the slots read come back as new
:class:`~accy_async.arrays.ArrayView` arrays instead of NumPy (on the CPU
backend they are NumPy either way: its device memory is the host's).

**Several devices.** A graph whose plan has ``device_count`` above one places
its nodes on devices (:attr:`~accy_async.plan.GraphNode.device`), and the call
takes a backend per device (``backend=[gpu0, gpu1]``, say
``open_backend("cuda:0")`` and ``"cuda:1"``). Each device runs its nodes in
list order on its lane's stream and keeps its own copy of each slot they use;
a slot written on one device and used on another is copied across on the
device (``cuMemcpyPeerAsync`` after a device-side wait between CUDA backends;
through the host between others), and a dependency the plan names across
devices is a device-side wait. Slots read back come from the device that
wrote them last.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, SupportsIndex

import anyio
import numpy as np

from ._graph_lane import GraphLane
from ._graph_schedule import schedule_of
from ._graph_spread import device_slots, run_spread
from ._loops import checkpoint
from .arrays import ArrayView
from .backends import Backend
from .errors import AccyError, LaunchArgumentMismatch, UnsupportedOperation
from .graph import launch_all, launch_graph
from .kernels import LaunchOptions, LoadedKernels, load_kernels
from .plan import LaunchGraphDocument, Slot
from .waiting import wait_stream

__all__ = ["DEFAULT_GRAPH_LANES", "GraphCall", "open_graph"]

DEFAULT_GRAPH_LANES: Final = 4
"""Calls that may run at once on one :class:`GraphCall` by default."""

GraphArrays = dict[int, Any]
"""What a graph call returns: ``{slot_id: array}`` for each slot read back."""

_CLOSED_BEFORE: Final = "the graph call was closed before this one ran"


def open_graph(
    document: LaunchGraphDocument,
    *,
    backend: Backend | Sequence[Backend],
    max_lanes: int = DEFAULT_GRAPH_LANES,
    device_graph: bool | None = None,
) -> GraphCall:
    """The launch graph of ``document`` as an awaitable function; see the module docstring.

    ``backend`` is one backend, or one per device index for a graph over
    several devices (at least the graph's ``device_count``). Use it as
    ``async with``: entering checks the graph against its plan and loads the
    kernels (on each backend), leaving waits for the calls in flight and
    frees everything. ``device_graph`` is
    :func:`~accy_async.graph.launch_graph`'s (``None``: a graph run before
    goes to the device as one graph where it can; one device only). A graph
    that waits for or signals the caller's events cannot be called this way
    (:class:`~accy_async.errors.UnsupportedOperation` on entering), nor one
    ``device_graph=True`` cannot make one device graph, nor one over more
    devices than backends given.
    """
    if max_lanes < 1:
        raise ValueError(f"max_lanes must be at least 1, not {max_lanes}")
    backends = [backend] if isinstance(backend, Backend) else list(backend)
    if not backends:
        raise ValueError("open_graph needs at least one backend")
    return GraphCall(document, backends, max_lanes, device_graph)


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
        backends: Sequence[Backend],
        max_lanes: int,
        device_graph: bool | None,
    ) -> None:
        self.document = document
        graph = document.graph
        self._devices = graph.device_count if graph is not None else 1
        self.backends = list(backends[: self._devices])
        """The backend of each device index (the first ``device_count`` given)."""
        self.backend = self.backends[0]
        """The backend of device 0 (the only one, for a graph on one device)."""
        self._device_graph = device_graph
        self._kernels: list[LoadedKernels] | None = None
        self._free: list[list[GraphLane]] = []
        self._slots = anyio.Semaphore(max_lanes)
        self._max_lanes = max_lanes
        self._closed = False
        plan = document.artifact_plan
        self._plan_slots: dict[int, Slot] = {slot.slot_id: slot for slot in plan.slots}
        self._default_read = tuple(dict.fromkeys(k.output_slot_id for k in plan.kernels))
        self._stream_count = graph.stream_count if graph is not None else 0
        self._device_slots: list[set[int]] = (
            device_slots(graph, plan)
            if graph is not None and self._devices > 1
            else [set(self._plan_slots)]
        )
        self._given_backends = len(backends)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def _closed_now(self) -> bool:
        """:attr:`closed`, read again after an await (a call, so type checkers do not narrow)."""
        return self._closed

    async def __aenter__(self) -> GraphCall:
        self._check_graph()
        loaded: dict[int, LoadedKernels] = {}
        try:
            for backend in self.backends:  # once per backend, whatever its device indices
                if id(backend) not in loaded:
                    plan = self.document.artifact_plan
                    loaded[id(backend)] = await load_kernels(backend, plan)
        except BaseException:
            await _each(kernels.aclose for kernels in loaded.values())
            raise
        self._kernels = [loaded[id(backend)] for backend in self.backends]
        return self

    def _check_graph(self) -> None:
        """Refuse, before anything loads, a graph this call cannot run."""
        graph = self.document.graph
        if graph is None:
            return
        schedule = schedule_of(graph, self.document.artifact_plan)  # checked against the plan
        if graph.event_count:
            raise UnsupportedOperation(
                f"the graph uses {graph.event_count} of the caller's events: a graph call "
                "binds none (use launch_graph)",
                path="$.graph.event_count",
            )
        if self._given_backends < self._devices:
            raise UnsupportedOperation(
                f"the graph runs on {self._devices} devices, {self._given_backends} "
                "backend(s) were given",
                path="$.graph.device_count",
            )
        if self._device_graph is True and (self._devices > 1 or schedule.graph_refusal):
            why = schedule.graph_refusal or "it spans several devices"
            raise UnsupportedOperation(
                f"this graph cannot be one device graph: {why}", path="$.graph"
            )

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
        crews, self._free = self._free, []
        loaded, self._kernels = self._kernels or [], None
        unique = {id(each): each for each in loaded}.values()
        try:
            await _each(kernels.aclose for kernels in unique)  # each waits for its streams
        finally:
            await _each(lane.release for crew in crews for lane in crew)

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
            crew = self._free.pop() if self._free else self._new_crew()
            try:
                results = await self._run(kernels, crew, request, device)
            except BaseException:
                # The devices may still use the lanes: they go once their streams are idle,
                # each after the others' (a copy out of a lane's buffer runs on another's).
                _join(crew)
                await _each(lane.release for lane in crew)
                raise
            self._free.append(crew)  # a close waits for this call to give its lanes back
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
            slot = self._plan_slots[slot_id]
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
            if not any(array.backend is each for each in self.backends) or not array.backend.owns(
                array.buffer
            ):
                raise LaunchArgumentMismatch(
                    f"slot {slot.slot_id}: the array is not a live array of this call's backends",
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

    def _new_crew(self) -> list[GraphLane]:
        """A lane per device index."""
        crew: list[GraphLane] = []
        try:
            plan, streams = self.document.artifact_plan, self._stream_count
            crew.extend(GraphLane.open(backend, plan, streams) for backend in self.backends)
        except BaseException:
            for lane in crew:
                lane.backend.destroy_all(lane.objects())
            raise
        return crew

    async def _run(
        self,
        kernels: list[LoadedKernels],
        crew: list[GraphLane],
        request: _Request,
        device: bool,
    ) -> GraphArrays:
        bindings = [
            lane.bind({slot: request.sizes[slot] for slot in slots})
            for lane, slots in zip(crew, self._device_slots, strict=True)
        ]
        for lane, lane_bindings in zip(crew, bindings, strict=True):
            await lane.put(lane_bindings, request.given)
        graph = self.document.graph
        lane = crew[0]
        if graph is not None and self._devices > 1:
            holders = await run_spread(graph, self.document.artifact_plan, crew, kernels, bindings)
            for each in crew:
                await wait_stream(each.backend, each.stream)
        else:
            holders = dict.fromkeys(bindings[0], 0)
            counts = list(lane.count_bindings.values())
            if graph is None:
                run = await launch_all(
                    kernels[0], bindings[0], counts, LaunchOptions(stream=lane.stream)
                )
            else:
                if lane.graph_streams:  # the graph's own streams start after the writes land
                    await wait_stream(lane.backend, lane.stream)
                run = await launch_graph(
                    kernels[0],
                    bindings[0],
                    graph,
                    counts,
                    streams=lane.graph_streams,
                    default_stream=lane.stream,
                    device_graph=self._device_graph,
                )
            await run.wait()
        results: GraphArrays = {}
        for slot_id in request.read:
            holder = holders[slot_id]
            results[slot_id] = await crew[holder].take(
                bindings[holder][slot_id], request.dtypes[slot_id], device
            )
        return results


async def _each(closers: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Await every ``closer()``, even once one raised (a cancellation, say); then the first error.

    A cancelled release hands its objects to the backend's deferred releases
    before it raises, so every one of them is released either way.
    """
    first: BaseException | None = None
    for close in closers:
        try:
            await close()
        except BaseException as error:  # noqa: BLE001 - raised below, after the rest
            first = first or error
    if first is not None:
        raise first


def _join(crew: Sequence[GraphLane]) -> None:
    """Each lane's stream waits, on the device, for every other lane's (where it can)."""
    if len(crew) < 2:
        return
    for lane in crew:
        for other in crew:
            if other is not lane:
                with contextlib.suppress(AccyError):  # cannot: its copies went through the host
                    lane.backend.follow_peer_stream(lane.stream, other.backend, other.stream)
