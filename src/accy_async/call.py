"""Arrays in, arrays out: a pipeline as an awaitable function.

::

    async with accy.open_pipeline("prefix_sum_f32", backend=backend) as scan:
        y = await scan(x)                     # x: a 1-D NumPy array of the plan's dtype

The call is the high-level face of :func:`~accy_async.pipeline.launch_pipeline`.
It takes the plan's operands as NumPy arrays, in the plan's order, and gives
back its results as new NumPy arrays (or fills the ``out=`` arrays given).
Runtime scalars come from the arrays where the plan sizes an operand by one
(``n = len(x)``), or by name (``await saxpy(x, y, a=2.0)``). The format, the
kernel pool, the scratch buffers and the streams are the call's business:
loaded once, sized for the largest request seen, reused.

On the CPU backend the arrays are used in place: the kernels read the
operands and write the results where they lie, no copy either way. On other
backends the operands are copied to the device and the results back.

Everything is checked before anything runs: the count, dtype and shape of
each array, the scalars, their types and bounds. Concurrent calls get their
own stream and scratch (up to ``max_lanes`` at once, the rest wait). A
cancelled call returns at once; what the device is still using, the caller's
arrays included, is released only once the device is done with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import numpy as np

from ._loops import admit, checkpoint
from .arrays import ArrayView
from .backends import (
    Backend,
    BufferBinding,
    BufferHandle,
    EventHandle,
    Ownership,
    StreamHandle,
    StreamLike,
)
from .buffers import download
from .dlpack import DLPackView
from .errors import AccyError, LaunchArgumentMismatch, UnsupportedOperation
from .interop import DeviceArray, Lease, cpu_array, device_array, empty_like
from .library import load_builtin
from .pipeline import (
    PipelineArtifactPool,
    PipelineIntermediates,
    Resolution,
    allocate_pipeline_intermediates,
    enqueue_checked,
    load_pipeline_artifacts,
    resolve_launch,
)
from .plan import (
    ArtifactFormat,
    DType,
    Forward,
    PipelineBuffer,
    PipelineDocument,
    ScalarArgument,
    resolve_quantity,
)
from .waiting import release_when_idle, wait_stream

__all__ = ["DEFAULT_LANES", "PipelineCall", "open_pipeline"]

DEFAULT_LANES: Final = 8
"""Calls that may run at once on one :class:`PipelineCall` by default."""

Arrays = Any
"""What a call returns: an array of the caller's kind, or a tuple of them."""

_Array = np.ndarray[Any, Any] | DeviceArray
"""An operand or result as checked: a NumPy array, or another library's device array."""

_NUMPY_DTYPES: Final = {dtype: np.dtype(dtype.numpy_name) for dtype in DType}
"""Each plan dtype's NumPy dtype (bf16 as its uint16 storage)."""

_RESOLUTIONS_KEPT: Final = 256
"""Distinct scalar values whose typing and sizes a call remembers (the oldest goes first)."""

_CLOSED_BEFORE: Final = "the pipeline call was closed before this one ran"


def open_pipeline(
    plan: str | PipelineDocument,
    *,
    backend: Backend,
    format: ArtifactFormat | None = None,
    max_lanes: int = DEFAULT_LANES,
) -> PipelineCall:
    """The pipeline ``plan`` (a built-in plan's name, or a document) as an awaitable function.

    Use it as an async context manager: entering loads the kernels, leaving
    waits for the calls' work and frees everything. The plan must describe
    its operands and results (``operands``, ``results`` in the document), as
    every built-in plan does.
    """
    document = load_builtin(plan) if isinstance(plan, str) else plan
    if max_lanes < 1:
        raise ValueError(f"max_lanes must be at least 1, got {max_lanes}")
    pipeline = document.pipeline
    if (pipeline.operand_count and not document.operands) or (
        pipeline.result_count and not document.results
    ):
        raise UnsupportedOperation(
            f"plan {pipeline.target!r} does not describe its operands and results "
            "(the document's 'operands' and 'results'): launch it with launch_pipeline"
        )
    return PipelineCall(document, backend, format, max_lanes)


_HELD_AT_MOST: Final = 64
"""Arrays and buffers a lane holds past their calls (released in one go) before it
hands them on."""

_QUERY_FROM: Final = 8
"""Held things below which a call does not ask whether the lane's last call is done."""


@dataclass(eq=False)
class _Lane:
    """One call's stream, scratch and (off the CPU) device copies of the arrays.

    A call runs on the lane's ``stream``, or on the caller's stream (see
    :meth:`PipelineCall.__call__`); ``where`` is the stream of the lane's
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

    def release_held(self, backend: Backend) -> None:
        """Let go of what earlier calls held if their work is done (or hand it on, if much)."""
        count = len(self.held) + len(self.owners)
        if not self.held and count < _QUERY_FROM:  # a few arrays: no need to ask yet
            return
        if self.done is None or backend.query_event(self.done):
            held, self.held = self.held, []
            self.owners = []
            backend.destroy_all(held)
        elif count >= _HELD_AT_MOST:
            self.settle(backend)
            held, self.held = self.held, []
            backend.defer_destroy([*held, *self._owners_held(backend)], after=self.stream)


class PipelineCall:
    """A loaded pipeline, called with arrays; see :func:`open_pipeline`."""

    def __init__(
        self,
        document: PipelineDocument,
        backend: Backend,
        format: ArtifactFormat | None,
        max_lanes: int,
    ) -> None:
        self.document = document
        self.backend = backend
        self._format = format
        self._pool: PipelineArtifactPool | None = None
        self._free: list[_Lane] = []
        self._slots = anyio.Semaphore(max_lanes, fast_acquire=True)
        """Lanes in use; a free one is taken without a yield (the launch is the checkpoint)."""
        self._retired_streams: list[StreamHandle] = []
        """Streams of lanes given up after a failure or cancellation, destroyed at close."""
        self._names = document.runtime_scalar_names or tuple(
            f"arg{index}" for index in range(document.pipeline.runtime_scalar_argument_count)
        )
        self._closed = False
        self._resolutions: dict[
            tuple[tuple[type, Any], ...], tuple[Resolution, tuple[int, ...], tuple[int, ...]]
        ] = {}

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def _closed_now(self) -> bool:
        """:attr:`closed`, read again after an await (a call, so type checkers do not narrow)."""
        return self._closed

    async def __aenter__(self) -> PipelineCall:
        pipeline = self.document.pipeline
        self._pool = await load_pipeline_artifacts(
            self.backend, pipeline, self.document.registry, self._format
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Wait for the calls' work, then free the lanes and unload the kernels.

        Cancelled, it returns at once; what the device still uses is released
        once it is done.
        """
        if self._closed:
            await checkpoint()
            return
        self._closed = True
        lanes, self._free = self._free, []
        for lane in lanes:
            lane.settle(self.backend)
        objects = [each for lane in lanes for each in lane.objects(self.backend)]
        streams = [*(lane.stream for lane in lanes), *self._retired_streams]
        self._retired_streams = []
        try:
            if self._pool is not None:
                await self._pool.aclose()  # waits for every stream it ran on
        finally:
            await release_when_idle(self.backend, [*objects, *streams], streams)

    async def __call__(
        self,
        *operands: Any,
        out: Any = None,
        stream: StreamLike | None = None,
        **scalars: ScalarArgument | int | float | np.generic,
    ) -> Arrays:
        """Run the pipeline on ``operands``; its result (a tuple of them if several).

        Operands are NumPy arrays or, on CUDA, any 1-D contiguous array with
        ``__cuda_array_interface__`` (CuPy, PyTorch) or DLPack; results are of
        the first device operand's kind (an :class:`~accy_async.arrays.ArrayView`,
        which exports DLPack, for operands offered through DLPack only; else
        NumPy), or ``out=``'s. With device arrays only, the call returns once
        the work is enqueued, with no host synchronisation: on ``stream`` when
        given (a PyTorch, CuPy or cuda.core stream, or accy-async's: the arrays
        are ready there and the results are used there); else on the arrays'
        stream when they all name one (PyTorch's current stream, CuPy's); else
        on a stream of the call's, ordered after each producer's stream and
        before each consumer's. In async code pass ``stream=``: PyTorch's
        current stream belongs to the thread, and other tasks change it at
        every ``await``. Results written into ``out=`` arrays offered only
        through DLPack are ready on CUDA's legacy default stream (DLPack names
        no stream of theirs to order). Raises :class:`LaunchArgumentMismatch`
        naming the array or scalar that does not fit, before anything runs.
        """
        if self._pool is None or self._closed:
            raise LaunchArgumentMismatch(
                "the pipeline call is not open (use it as 'async with open_pipeline(...)')"
            )
        document = self.document
        arrays = self._check_operands(operands)
        resolution, counts = self._scalars(arrays, scalars)
        given_stream = None if stream is None else self.backend.adopt_stream(stream)
        results = self._results(out, counts, arrays, given_stream)
        on_cpu = self.backend.kind == "cpu"
        if on_cpu:
            _refuse_device_arrays(arrays, results)
        await self._slots.acquire()
        try:
            if self._closed_now():
                raise LaunchArgumentMismatch(_CLOSED_BEFORE)
            lane = self._free.pop() if self._free else _Lane(self.backend.create_stream())
            try:
                await self._fit(lane, resolution)
            except BaseException:
                self._retire(lane)
                raise
            if on_cpu:
                await self._run_in_place(lane, arrays, results, resolution)  # type: ignore[arg-type]
            else:
                await self._run_on_device(lane, arrays, results, resolution, given_stream)
            if self._closed_now():  # closed while this call ran: nobody will reuse the lane
                self._retire(lane)
            else:
                self._free.append(lane)
        finally:
            self._slots.release()
        given = [each.owner if isinstance(each, DeviceArray) else each for each in results]
        return given[0] if document.pipeline.result_count == 1 else tuple(given)

    # ----- checks -----------------------------------------------------------------------

    def _check_operands(self, operands: Sequence[Any]) -> list[_Array]:
        shapes = self.document.operands
        if len(operands) != len(shapes):
            names = ", ".join(shape.name for shape in shapes)
            raise LaunchArgumentMismatch(
                f"{self.document.pipeline.target!r} takes {len(shapes)} operands ({names}), "
                f"got {len(operands)}",
                path="$.operands",
            )
        return [
            _checked(array, shape, f"operand {index} ({shape.name!r})", f"$.operands[{index}]")
            for index, (array, shape) in enumerate(zip(operands, shapes, strict=True))
        ]

    def _scalars(
        self,
        arrays: Sequence[_Array],
        given: Mapping[str, ScalarArgument | int | float | np.generic],
    ) -> tuple[Resolution, tuple[int, ...]]:
        """What the runtime scalars decide, and how many elements each result takes.

        A scalar is given by name, or is the length of an operand the plan sizes by it.
        """
        names = self._names
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise LaunchArgumentMismatch(
                f"no runtime scalar named {unknown[0]!r}; the plan has {', '.join(names)}",
                path="$.runtime_scalar_arguments",
            )
        values: list[ScalarArgument | int | float] = []
        for index, name in enumerate(names):
            if name in given:
                value = given[name]
                if isinstance(value, np.integer | np.floating):
                    value = value.item()  # a NumPy scalar (x.mean(), len as np.int64)
                values.append(value)  # type: ignore[arg-type]  # checked just below
                continue
            lengths = {
                shape.name: array.size
                for array, shape in zip(arrays, self.document.operands, strict=True)
                if isinstance(shape.extent, Forward) and shape.extent.argument_index == index
            }
            if not lengths:
                raise LaunchArgumentMismatch(
                    f"runtime scalar {name!r} is not the length of an operand: pass {name}=...",
                    path=f"$.runtime_scalar_arguments[{index}]",
                )
            if len(set(lengths.values())) > 1:
                described = ", ".join(f"{key} has {value}" for key, value in lengths.items())
                raise LaunchArgumentMismatch(
                    f"operands sized by {name!r} differ in length ({described})",
                    path="$.operands",
                )
            length = next(iter(lengths.values()))
            if length == 0:
                raise LaunchArgumentMismatch(
                    f"operand {next(iter(lengths))!r} is empty", path="$.operands"
                )
            values.append(length)
        resolution, needs, counts = self._resolved(values)
        for index, (array, shape, needed) in enumerate(
            zip(arrays, self.document.operands, needs, strict=True)
        ):
            if array.size < needed:
                raise LaunchArgumentMismatch(
                    f"operand {index} ({shape.name!r}) has {array.size} elements, "
                    f"the launch needs {needed}",
                    path=f"$.operands[{index}]",
                )
        return resolution, counts

    def _resolved(
        self, values: Sequence[ScalarArgument | int | float]
    ) -> tuple[Resolution, tuple[int, ...], tuple[int, ...]]:
        """What the scalars decide, and the elements each operand and result needs.

        Cached by value (:func:`resolve_launch` caches per pipeline too, but keyed by
        typed scalars only). The key holds each value's type, so ``5`` and ``5.0``
        (equal, one hash) are checked apart.
        """
        key = tuple([(type(value), value) for value in values])
        cached = self._resolutions.get(key)
        if cached is not None:
            return cached
        assert self._pool is not None
        resolution = resolve_launch(self._pool, values)
        arguments = resolution.arguments
        document = self.document
        cached = (
            resolution,
            tuple(resolve_quantity(shape.extent, arguments) for shape in document.operands),
            tuple(resolve_quantity(shape.extent, arguments) for shape in document.results),
        )
        self._resolutions[key] = cached
        if len(self._resolutions) > _RESOLUTIONS_KEPT:
            del self._resolutions[next(iter(self._resolutions))]
        return cached

    def _results(
        self,
        out: Any,
        counts: Sequence[int],
        operands: Sequence[_Array],
        stream: StreamHandle | None,
    ) -> list[_Array]:
        """Where the results land: ``out``'s arrays (checked), or new ones of the operands' kind.

        New ones are allocated for use on ``stream`` when the caller named one.
        """
        shapes = self.document.results
        if out is None:
            model = next((each for each in operands if isinstance(each, DeviceArray)), None)
            made: list[_Array] = []
            for index, (shape, count) in enumerate(zip(shapes, counts, strict=True)):
                if model is None:
                    made.append(np.empty(count, _numpy_dtype(shape)))
                    continue
                what, path = f"result {index} ({shape.name!r})", f"$.out[{index}]"
                dtype = _numpy_dtype(shape)
                if isinstance(model.owner, DLPackView):  # no way to make one of their kind
                    buffer = self.backend.allocate_buffer(max(count * dtype.itemsize, 1))
                    view = ArrayView(self.backend, buffer, dtype, count, owned=True)
                    made.append(DeviceArray(view, view.address, dtype, count, False, None))
                    continue
                raw = None if stream is None else stream.__cuda_stream__()[1]
                new = empty_like(model.owner, dtype, count, what, raw)
                device = device_array(new, what, path)
                assert device is not None
                made.append(device)
            return made
        given = list(out) if isinstance(out, list | tuple) else [out]
        if len(given) != len(shapes):
            raise LaunchArgumentMismatch(
                f"out= has {len(given)} arrays, the plan has {len(shapes)} results", path="$.out"
            )
        checked = []
        for index, (array, shape, count) in enumerate(zip(given, shapes, counts, strict=True)):
            what, path = f"result {index} ({shape.name!r})", f"$.out[{index}]"
            item = _checked(array, shape, what, path, out=True)
            readonly = item.readonly if isinstance(item, DeviceArray) else not item.flags.writeable
            if readonly:
                raise LaunchArgumentMismatch(f"{what}: the out= array is read-only", path=path)
            if item.size < count:
                raise LaunchArgumentMismatch(
                    f"{what} has {item.size} elements, the launch needs {count}", path=path
                )
            checked.append(item)
        return checked

    # ----- lanes ------------------------------------------------------------------------

    async def _fit(self, lane: _Lane, resolution: Resolution) -> None:
        """Grow the lane's scratch to fit the scalars ``resolution`` was made for."""
        pipeline = self.document.pipeline
        needed = resolution.intermediate_sizes
        scratch = lane.scratch
        if needed and (
            scratch is None
            or any(b.byte_size < size for b, size in zip(scratch, needed, strict=True))
        ):
            lane.scratch = None
            if scratch is not None:
                lane.settle(self.backend)  # the scratch may be in use on a caller's stream
                await scratch.aclose()
            lane.scratch = await allocate_pipeline_intermediates(
                self.backend, pipeline, resolution.arguments
            )

    def _device_buffer(self, lane: _Lane, key: tuple[str, int], byte_size: int) -> BufferHandle:
        """The lane's device buffer ``key``, grown to ``byte_size`` (off the CPU).

        The old one is held until the lane's earlier calls are done (see :class:`_Lane`).
        """
        buffer = lane.buffers.get(key)
        if buffer is None or buffer.byte_size < byte_size:
            if buffer is not None:
                del lane.buffers[key]
                lane.held.append(buffer)
            buffer = lane.buffers[key] = self.backend.allocate_buffer(max(byte_size, 1))
        return buffer

    def _retire(
        self, lane: _Lane, owners: Sequence[Any] = (), objects: Sequence[BufferHandle] = ()
    ) -> None:
        """A lane whose work may still run (a cancelled or failed call): free it afterwards.

        Its stream lives on until :meth:`aclose` (the pool waits for it before
        unloading the kernels it may still run), unless the call is closed already.
        """
        if lane.where is not None and lane.where is not lane.stream:
            with contextlib.suppress(AccyError):  # what was enqueued there, if anything
                lane.ran(self.backend, lane.where)
        lane.settle(self.backend)
        lane.owners.extend(owners)
        released: list[Any] = [*objects, *lane.objects(self.backend)]
        if self._closed:
            released.append(lane.stream)
        else:
            self._retired_streams.append(lane.stream)
        self.backend.defer_destroy(released, after=lane.stream)

    async def _enqueue(
        self,
        lane: _Lane,
        stream: StreamHandle,
        operands: Sequence[BufferBinding],
        results: Sequence[BufferBinding],
        resolution: Resolution,
    ) -> None:
        """The checkpoint, then the stages on ``stream`` (everything was checked before)."""
        assert self._pool is not None
        await admit()
        if self._closed_now():
            raise LaunchArgumentMismatch(_CLOSED_BEFORE)
        enqueue_checked(
            self._pool, resolution, operands, results, lane.scratch, stream, track=lane.stream
        )
        lane.ran(self.backend, stream)

    # ----- running ----------------------------------------------------------------------

    async def _run_in_place(
        self,
        lane: _Lane,
        arrays: Sequence[np.ndarray[Any, Any]],
        results: Sequence[np.ndarray[Any, Any]],
        resolution: Resolution,
    ) -> None:
        """CPU: the kernels read and write the caller's arrays where they lie."""
        backend = self.backend
        handles: list[BufferHandle] = []
        try:
            for array in (*arrays, *results):
                native = array.reshape(-1).view(np.uint8)
                handles.append(backend.register_external_buffer(native, native.size))
            count = len(arrays)
            await self._enqueue(
                lane,
                lane.stream,
                [handle.bind("read_only") for handle in handles[:count]],
                [handle.bind() for handle in handles[count:]],
                resolution,
            )
            await wait_stream(backend, lane.stream)
        except BaseException:
            self._retire(lane, objects=handles)  # the arrays stay referenced until it is done
            raise
        backend.destroy_all(handles)

    async def _run_on_device(
        self,
        lane: _Lane,
        arrays: Sequence[_Array],
        results: Sequence[_Array],
        resolution: Resolution,
        given: StreamHandle | None,
    ) -> None:
        """Off the CPU: device arrays in place, NumPy arrays copied in and out.

        On the ``given`` stream, everything runs there (copies too). Else, when
        every array is a device array from one stream (PyTorch's or CuPy's
        current stream, as a rule), the stages run on that stream itself, as the
        library's own operations would: stream order is all the ordering needed.
        Otherwise they run on the lane's stream, ordered after each producer's
        stream and before each consumer's by device-side waits.
        """
        backend = self.backend
        owners: list[Any] = []
        try:
            foreigners = _streams((*arrays, *results))  # results' memory may be in use there
            direct = given is not None or (
                len(foreigners) == 1
                and all(isinstance(item, DeviceArray) for item in (*arrays, *results))
            )
            if given is not None:
                stream = given
            elif direct:
                stream = backend.adopt_stream(foreigners[0])
            else:
                stream = lane.stream
            lane.release_held(backend)
            lane.follow(backend, stream)  # the scratch (and copies) were in use there
            lane.where = stream  # from here a failure must wait for `stream` (see _retire)
            if not direct:
                for foreign in foreigners:
                    backend.follow_foreign_stream(stream, foreign)
            bindings = []
            for key, items in (("operand", arrays), ("result", results)):
                access = "read_only" if key == "operand" else "read_write"
                for index, item in enumerate(items):
                    size = max(item.nbytes, 1)
                    if isinstance(item, DeviceArray):
                        # Not registered with the backend: the call checked it, and the lane
                        # keeps its owner referenced until the work is done.
                        handle = BufferHandle(
                            backend.backend_id,
                            0,
                            None,
                            size,
                            ownership=Ownership.EXTERNAL,
                            address=item.address,
                        )
                        owners.append(item.owner)
                    else:
                        handle = self._device_buffer(lane, (key, index), size)
                        if key == "operand" and item.nbytes:
                            data = item.reshape(-1).view(np.uint8).data
                            backend.write_buffer(handle, data, stream=stream)
                    bindings.append(handle.bind(access, byte_size=size))  # type: ignore[arg-type]
            count = len(arrays)
            await self._enqueue(lane, stream, bindings[:count], bindings[count:], resolution)
            if not direct:
                for foreign in _streams(results):
                    backend.lead_foreign_stream(foreign, stream)
            for item in results:
                owner = item.owner if isinstance(item, DeviceArray) else None
                if isinstance(owner, ArrayView) and owner.stream is None:  # written here
                    owner.stream = stream
            for index, item in enumerate(results):
                if isinstance(item, np.ndarray):
                    values = await download(
                        backend,
                        lane.buffers[("result", index)],
                        item.dtype,
                        item.size,
                        stream=stream,
                    )
                    item.reshape(-1)[...] = values
        except BaseException:
            self._retire(lane, owners)  # the arrays stay referenced until the work is done
            raise
        lane.owners.extend(owners)


def _streams(items: Sequence[_Array]) -> list[int]:
    """The distinct foreign streams of the device arrays among ``items``, in order."""
    streams = (item.stream for item in items if isinstance(item, DeviceArray))
    return list(dict.fromkeys(stream for stream in streams if stream is not None))


def _refuse_device_arrays(arrays: Sequence[_Array], results: Sequence[_Array]) -> None:
    for what, items in (("operand", arrays), ("result", results)):
        for index, item in enumerate(items):
            if isinstance(item, DeviceArray):
                path = f"$.operands[{index}]" if what == "operand" else f"$.out[{index}]"
                raise LaunchArgumentMismatch(
                    f"{what} {index} is a {type(item.owner).__name__} in GPU memory; "
                    "the cpu backend takes NumPy arrays",
                    path=path,
                )


def _checked(
    array: Any, shape: PipelineBuffer, what: str, path: str, *, out: bool = False
) -> _Array:
    """A device array (its dtype checked), or a NumPy array (see :func:`_checked_array`)."""
    if isinstance(array, np.ndarray):
        return _checked_array(array, shape, what, path)
    device = device_array(array, what, path)
    if device is None:  # host memory offered through DLPack: a NumPy view of it
        return _checked_array(cpu_array(array), shape, what, path)
    expected = _numpy_dtype(shape)
    if device.dtype != expected:
        raise LaunchArgumentMismatch(
            f"{what} holds {device.dtype}, the plan takes {expected}", path=path
        )
    return device


def _numpy_dtype(shape: PipelineBuffer) -> np.dtype[Any]:
    return _NUMPY_DTYPES[shape.dtype]


def _checked_array(array: Any, shape: PipelineBuffer, what: str, path: str) -> np.ndarray[Any, Any]:
    """``array`` as a 1-D C-contiguous NumPy array of the shape's dtype, or a clear error."""
    if not isinstance(array, np.ndarray):
        kind = type(array).__name__
        raise LaunchArgumentMismatch(
            f"{what} is a {kind}, not an array (NumPy, or on CUDA one with "
            "__cuda_array_interface__)",
            path=path,
        )
    expected = _numpy_dtype(shape)
    if array.dtype != expected:
        raise LaunchArgumentMismatch(
            f"{what} holds {array.dtype}, the plan takes {expected} "
            f"(convert it first: array.astype(np.{expected}))",
            path=path,
        )
    if array.ndim != 1:
        raise LaunchArgumentMismatch(
            f"{what} has shape {array.shape}, the plan takes a 1-D array", path=path
        )
    if not array.flags.c_contiguous:
        raise LaunchArgumentMismatch(
            f"{what} is not contiguous (pass np.ascontiguousarray(...))", path=path
        )
    return array
