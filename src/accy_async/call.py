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

This module opens the call and runs it. Each call's arrays and scalars are
checked in :mod:`accy_async._call_intake`; a call runs on a lane (its stream,
scratch and device copies) of :mod:`accy_async._call_lane`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Final

import anyio
import anyio.lowlevel
import numpy as np

from ._call_intake import Array, Intake, refuse_device_arrays
from ._call_lane import Lane
from ._call_replay import REPLAYS_KEPT, Replay, replay_key
from ._loops import admit, checkpoint
from .arrays import ArrayView
from .backends import (
    Access,
    Backend,
    BufferBinding,
    BufferHandle,
    NodeArguments,
    StreamHandle,
    StreamLike,
)
from .buffers import download
from .errors import AccyError, LaunchArgumentMismatch, UnsupportedOperation
from .interop import DeviceArray
from .library import load_builtin
from .pipeline import (
    PipelineArtifactPool,
    Resolution,
    enqueue_checked,
    launch_packed,
    load_pipeline_artifacts,
    pack_stages,
)
from .plan import ArtifactFormat, PipelineDocument, ScalarArgument
from .waiting import release_when_idle, wait_stream

__all__ = ["DEFAULT_LANES", "PipelineCall", "open_pipeline"]

DEFAULT_LANES: Final = 8
"""Calls that may run at once on one :class:`PipelineCall` by default."""

Arrays = Any
"""What a call returns: an array of the caller's kind, or a tuple of them."""

_CLOSED_BEFORE: Final = "the pipeline call was closed before this one ran"


def open_pipeline(
    plan: str | PipelineDocument,
    *,
    backend: Backend,
    format: ArtifactFormat | None = None,
    max_lanes: int = DEFAULT_LANES,
    device_graph: bool = False,
) -> PipelineCall:
    """The pipeline ``plan`` (a built-in plan's name, or a document) as an awaitable function.

    Use it as an async context manager: entering loads the kernels, leaving
    waits for the calls' work and frees everything. The plan must describe
    its operands and results (``operands``, ``results`` in the document), as
    every built-in plan does. With ``device_graph=True`` a call's stages go
    to the device as one graph (instantiated once per size, each call's
    arrays patched in): worth it for a pipeline of several stages called
    with a few sizes again and again; by default stage by stage.
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
    return PipelineCall(document, backend, format, max_lanes, device_graph)


class PipelineCall:
    """A loaded pipeline, called with arrays; see :func:`open_pipeline`."""

    def __init__(
        self,
        document: PipelineDocument,
        backend: Backend,
        format: ArtifactFormat | None,
        max_lanes: int,
        device_graph: bool = False,
    ) -> None:
        self.document = document
        self._device_graph = device_graph
        self.backend = backend
        self._format = format
        self._pool: PipelineArtifactPool | None = None
        self._free: list[Lane] = []
        self._slots = anyio.Semaphore(max_lanes, fast_acquire=True)
        """Lanes in use; a free one is taken without a yield (the call's admission was one)."""
        self._retired_streams: list[StreamHandle] = []
        """Streams of lanes given up after a failure or cancellation, destroyed at close."""
        self._closed = False
        self._intake = Intake(document)
        """Checks each call's arrays and scalars (and remembers what the scalars decide)."""

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

    def _open_pool(self) -> PipelineArtifactPool:
        """The call's pool; :class:`LaunchArgumentMismatch` if the call is not open."""
        if self._pool is None or self._closed:
            raise LaunchArgumentMismatch(
                "the pipeline call is not open (use it as 'async with open_pipeline(...)')"
            )
        return self._pool

    def let_go(self) -> None:
        """Let go of the arrays earlier calls still hold, once the device is done with them.

        A call keeps the caller's device arrays (and buffers it outgrew)
        referenced past its return, until a later call on its lane finds its
        work done; a caller that dropped such arrays and wants their memory
        back sooner calls this. Lanes in use by a call are left alone.
        """
        for lane in self._free:
            lane.release_held(self.backend, all_now=True)

    def result_sizes(
        self, *operands: Any, **scalars: ScalarArgument | int | float | np.generic
    ) -> tuple[int, ...]:
        """How many elements each result of a call on ``operands`` and ``scalars`` takes.

        For callers that allocate ``out=`` arrays themselves; checked as a call checks
        them (:class:`LaunchArgumentMismatch`). Nothing is enqueued.
        """
        pool = self._open_pool()
        arrays = self._intake.operands(operands)
        return self._intake.scalars(pool, arrays, scalars)[1]

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
        # The checkpoint first: a call cancelled here has checked and taken nothing, and the
        # rest runs in one step of the loop (unless it waits for a lane or grows the scratch).
        was_open = self._pool is not None and not self._closed
        await admit()
        if was_open and self._closed_now():
            raise LaunchArgumentMismatch(_CLOSED_BEFORE)
        pool = self._open_pool()
        document = self.document
        on_cpu = self.backend.kind == "cpu"
        outs = None if out is None else out if isinstance(out, list | tuple) else (out,)
        key = None
        if outs is not None and not on_cpu:
            key = self._replay_key(operands, outs, stream, scalars)
            if key is not None and self._free and self._replayed(key, operands, outs):
                return _returned(document, outs)
        arrays = self._intake.operands(operands)
        resolution, counts = self._intake.scalars(pool, arrays, scalars)
        given_stream = None if stream is None else self.backend.adopt_stream(stream)
        results = self._intake.results(self.backend, out, counts, arrays, given_stream)
        if on_cpu:
            refuse_device_arrays(arrays, results)
        try:
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            await self._slots.acquire()
        try:
            if self._closed_now():
                raise LaunchArgumentMismatch(_CLOSED_BEFORE)
            lane = self._free.pop() if self._free else Lane(self.backend.create_stream())
            try:
                await lane.fit(self.backend, document.pipeline, resolution)
            except BaseException:
                self._retire(lane)
                raise
            if on_cpu:
                await self._run_in_place(lane, arrays, results, resolution)  # type: ignore[arg-type]
            else:
                await self._run_on_device(lane, arrays, results, resolution, given_stream, key)
            if self._closed_now():  # closed while this call ran: nobody will reuse the lane
                self._retire(lane)
            else:
                self._free.append(lane)
        finally:
            self._slots.release()
        return _returned(
            document, [each.owner if isinstance(each, DeviceArray) else each for each in results]
        )

    # ----- lanes ------------------------------------------------------------------------

    def _replay_key(
        self,
        operands: Sequence[Any],
        outs: Sequence[Any],
        stream: StreamLike | None,
        scalars: Any,
    ) -> tuple[object, ...] | None:
        """The call's replay key (:func:`replay_key`).

        ``None`` also when ``stream`` is not one: the checks say so, after the arrays'.
        """
        try:
            given = None if stream is None else self.backend.adopt_stream(stream)
        except AccyError:
            return None
        return replay_key(operands, outs, given, scalars)

    def _replayed(
        self, key: tuple[object, ...], operands: Sequence[Any], outs: Sequence[Any]
    ) -> bool:
        """Launch a call like one launched twice before on a free lane, if there is one.

        ``False`` (nothing done) when the lane has no replay of ``key``: the
        call goes the checked way. The lane is taken without a slot: it is back
        among the free ones before anything awaits, so no other call sees it in use.
        """
        lane = self._free[-1]
        try:
            replay = lane.replays.get(key)
        except TypeError:  # something unhashable in an array's description
            return False
        if replay is None or not replay.holds(self.backend):
            return False
        self._free.pop()
        try:
            self._launch_replay(lane, replay)
        except BaseException:
            self._retire(lane, [*operands, *outs])  # referenced until the work is done
            raise
        owners = lane.owners
        owners += operands
        owners += outs
        self._free.append(lane)
        return True

    def _launch_replay(self, lane: Lane, replay: Replay) -> None:
        """Enqueue a replayed call's stages on its stream, as :meth:`_run_on_device` did."""
        backend = self.backend
        stream = replay.stream
        lane.release_held(backend)
        lane.follow(backend, stream)
        lane.where = stream
        graph = None
        arguments: Sequence[NodeArguments] = ()
        if replay.graph is not None:
            assert self._pool is not None
            configs, arguments = replay.graph
            graph = self._pool.graph_for(configs, True)
        launch_packed(backend, replay.stages, stream, graph, arguments)
        lane.ran(backend, stream)

    def _remember(
        self,
        lane: Lane,
        key: tuple[object, ...],
        stream: StreamHandle,
        operands: Sequence[BufferBinding],
        results: Sequence[BufferBinding],
        resolution: Resolution,
    ) -> None:
        """Note a call of ``key`` launched on ``lane``; seen before, pack it for replays."""
        replays = lane.replays
        try:
            seen = key in replays
        except TypeError:  # something unhashable in an array's description
            return
        if not seen:
            if len(replays) >= REPLAYS_KEPT:
                replays.clear()
            replays[key] = None
            return
        assert self._pool is not None
        arguments, stages = pack_stages(self._pool, resolution, operands, results, lane.scratch)
        graph = (resolution.configs, arguments) if self._device_graph else None
        replays[key] = Replay(stream, stages, graph, self.backend.removals)

    def _retire(
        self, lane: Lane, owners: Sequence[Any] = (), objects: Sequence[BufferHandle] = ()
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

    def _enqueue(
        self,
        lane: Lane,
        stream: StreamHandle,
        operands: Sequence[BufferBinding],
        results: Sequence[BufferBinding],
        resolution: Resolution,
    ) -> None:
        """The stages on ``stream`` (everything was checked before)."""
        assert self._pool is not None
        if self._closed_now():
            raise LaunchArgumentMismatch(_CLOSED_BEFORE)
        enqueue_checked(
            self._pool,
            resolution,
            operands,
            results,
            lane.scratch,
            stream,
            track=lane.stream,
            device_graph=self._device_graph,
        )
        lane.ran(self.backend, stream)

    # ----- running ----------------------------------------------------------------------

    async def _run_in_place(
        self,
        lane: Lane,
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
            self._enqueue(
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
        lane: Lane,
        arrays: Sequence[Array],
        results: Sequence[Array],
        resolution: Resolution,
        given: StreamHandle | None,
        replay_as: tuple[object, ...] | None = None,
    ) -> None:
        """Off the CPU: device arrays in place, NumPy arrays copied in and out.

        On the ``given`` stream, everything runs there (copies too). Else, when
        every array is a device array from one stream (PyTorch's or CuPy's
        current stream, as a rule), the stages run on that stream itself, as the
        library's own operations would: stream order is all the ordering needed.
        Otherwise they run on the lane's stream, ordered after each producer's
        stream and before each consumer's by device-side waits. A call with a
        replay key (``replay_as``) that ran on its arrays' (or the given) stream is
        remembered for replays (:mod:`accy_async._call_replay`).
        """
        backend = self.backend
        owners: list[Any] = []
        try:
            # The results' memory may be in use on their streams too.
            foreigners, all_on_device = _foreign_streams(arrays, results)
            direct = given is not None or (len(foreigners) == 1 and all_on_device)
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
                access: Access = "read_only" if key == "operand" else "read_write"
                for index, item in enumerate(items):
                    size = max(item.nbytes, 1)
                    if isinstance(item, DeviceArray):
                        bindings.append(lane.external_binding(backend, item.address, size, access))
                        owners.append(item.owner)
                        continue
                    handle = lane.device_buffer(backend, (key, index), size)
                    if key == "operand" and item.nbytes:
                        data = item.reshape(-1).view(np.uint8).data
                        backend.write_buffer(handle, data, stream=stream)
                    bindings.append(handle.bind(access, byte_size=size))
            count = len(arrays)
            self._enqueue(lane, stream, bindings[:count], bindings[count:], resolution)
            if replay_as is not None and direct:
                self._remember(
                    lane, replay_as, stream, bindings[:count], bindings[count:], resolution
                )
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


def _returned(document: PipelineDocument, results: Sequence[Any]) -> Arrays:
    """What a call gives back: its one result, or a tuple of them."""
    return results[0] if document.pipeline.result_count == 1 else tuple(results)


def _streams(items: Sequence[Array]) -> list[int]:
    """The distinct foreign streams of the device arrays among ``items``, in order."""
    return _foreign_streams(items, ())[0]


def _foreign_streams(*groups: Sequence[Array]) -> tuple[list[int], bool]:
    """The distinct foreign streams of the device arrays in ``groups``, in order.

    And whether every item is a device array.
    """
    streams: list[int] = []
    all_on_device = True
    for items in groups:
        for item in items:
            if not isinstance(item, DeviceArray):
                all_on_device = False
                continue
            stream = item.stream
            if stream is not None and stream not in streams:
                streams.append(stream)
    return streams, all_on_device
