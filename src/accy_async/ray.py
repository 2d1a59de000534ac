"""Scaling out with Ray: one async actor per device, a router that keeps requests on warm pools.

Optional (``pip install 'accy-async[ray]'``). :class:`PipelineActor` is a Ray
actor class that owns one backend (``"auto"``: CUDA on a GPU node, the CPU
backend elsewhere) and the high-level calls of the plans it served
(:func:`accy_async.open_pipeline`: kernels loaded once, scratch reused); its
methods are ``async def`` and never block its event loop. :class:`Router`,
on the driver, sends each request to an actor whose call for that plan is
already warm and has room, else to the least loaded, with at most ``max_in_flight``
requests on each actor at once (the rest wait: backpressure, not a queue
that grows without bound).

A request names a built-in plan (or one the actors tuned) or passes a
:class:`~accy_async.plan.PipelineDocument`, and may ask for its stages as one
device graph (``device_graph=True``); :meth:`Router.call_graph` runs a
:class:`~accy_async.plan.LaunchGraphDocument` with arrays for its slots
(:func:`accy_async.open_graph` on the actor). :meth:`Router.tune` tunes a
pipeline problem on one actor and hands the winning plan to every actor, which
then serves it under the problem's name. With
``keep=True`` its results stay on the actor (in device memory on CUDA) and come
back as :class:`Resident` handles: pass them to later calls, which the router
sends to the same actor (chained calls move no data through Ray), then
:meth:`Router.fetch` them as NumPy or :meth:`Router.release` them. A kept
result dies with its actor: a call that needs it then raises
:class:`~accy_async.errors.RuntimeUnavailable`.

Every request carries an id. If its actor dies, the router sends it again,
with the same id, to another actor, and the caller gets one answer; an actor
that sees an id again (a retry that reaches it) answers from its record
instead of running the request twice. A request whose actor died after
running it may run again on the other actor. Cancelling the
caller cancels the remote call (``ray.cancel``). Arrays travel as NumPy
through Ray's object store (read without a copy where Ray can) and come back
as NumPy. The router runs on asyncio (Ray's awaitable object references).

A sketch::

    ray.init()
    actors = [PipelineActor.options(num_gpus=1).remote() for _ in range(2)]
    router = Router(actors)
    (y,) = await router.call("prefix_sum_f32", x)  # the results, as a list
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import numpy as np

try:
    import ray
except ImportError as exc:  # pragma: no cover - the optional extra
    from .errors import RuntimeUnavailable

    raise RuntimeUnavailable(
        f"accy_async.ray needs Ray: pip install 'accy-async[ray]' ({exc})"
    ) from exc

from ._cache import IdentityCache
from .arrays import ArrayView
from .backends import Backend, create_backend
from .buffers import download
from .call import PipelineCall, open_pipeline
from .errors import AccyError, LaunchArgumentMismatch, RuntimeUnavailable
from .graph_call import GraphCall, open_graph
from .library import BUILTIN_PLANS
from .plan import LaunchGraphDocument, PipelineDocument, PipelineTuningProblem, encode_json
from .testing import live_after_drain
from .tuning import Tuner, TuningResult, TuningSettings

__all__ = ["DEFAULT_IN_FLIGHT", "PipelineActor", "PipelineActorImpl", "Resident", "Router"]

DEFAULT_IN_FLIGHT: Final = 8
"""Requests one actor runs at once by default."""

_ANSWERS_KEPT: Final = 4096
_UNAVAILABLE_RETRY_S: Final = 0.05
"""How long the router waits before asking an actor Ray calls unavailable for the moment."""

Plan = str | PipelineDocument
"""A built-in (or tuned) plan's name, or a plan document."""

Answer = list[Any] | dict[int, Any]
"""A request's results: a pipeline call's list, a graph call's ``{slot_id: array}``."""


@dataclass(frozen=True, slots=True)
class Resident:
    """A result kept on the actor that made it (``keep=True``): ``size`` elements of ``dtype``.

    Pass it as an operand to a later call (the router sends that call to the
    same actor), :meth:`Router.fetch` it as NumPy, :meth:`Router.release` it.
    """

    holder: str
    """The actor's name for itself (:attr:`PipelineActorImpl.identity`)."""
    key: str
    dtype: str
    size: int


class PipelineActorImpl:
    """What :data:`PipelineActor` runs inside Ray; plain Python, so it can be tested alone.

    The backend opens on the first request (an actor's ``__init__`` cannot
    await); the calls stay open until :meth:`close`.
    """

    def __init__(self, backend: str = "auto") -> None:
        self._kind = backend
        self._backend: Backend | None = None
        self._calls: dict[tuple[str, bool], PipelineCall] = {}
        self._graphs: dict[tuple[str, bool | None], GraphCall] = {}
        self._tuned: dict[str, PipelineDocument] = {}
        """Plans tuned here or handed over (:meth:`adopt`), by their problem's name."""
        self._lock = asyncio.Lock()
        self._answers: OrderedDict[str, Answer] = OrderedDict()
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._kept: dict[str, Any] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        """Requests whose caller went away (:meth:`forget`), possibly before they ran here."""
        self.identity = uuid.uuid4().hex
        """The name the results this actor keeps carry (:attr:`Resident.holder`)."""
        self.served = 0
        """Requests run here (an answer given again from its record not counted)."""

    async def call(
        self,
        request_id: str,
        plan: Plan,
        arrays: Sequence[Any],
        scalars: dict[str, int | float] | None = None,
        *,
        keep: bool = False,
        device_graph: bool = False,
    ) -> list[Any]:
        """Run ``plan`` on ``arrays`` (NumPy arrays, or :class:`Resident` results kept here).

        Its results as NumPy arrays, or with ``keep`` as :class:`Resident`
        handles to results kept here. A request id seen before is answered
        as before (from its record, or by awaiting the run already going),
        not run again.
        """
        answer = await self._once(
            request_id,
            lambda: self._run(plan, list(arrays), dict(scalars or {}), keep, device_graph),
            [],
        )
        assert isinstance(answer, list)
        return answer

    async def call_graph(
        self,
        request_id: str,
        document: LaunchGraphDocument,
        inputs: dict[int, Any],
        read: Sequence[int] | None = None,
        *,
        keep: bool = False,
        device_graph: bool | None = None,
    ) -> dict[int, Any]:
        """Run the launch graph of ``document`` with ``inputs`` for its slots (:func:`open_graph`).

        ``inputs`` maps slot ids to NumPy arrays or :class:`Resident` results
        kept here; the slots ``read`` come back as NumPy arrays, or with
        ``keep`` as :class:`Resident` handles. Answered once per request id, as
        :meth:`call` is.
        """
        answer = await self._once(
            request_id,
            lambda: self._run_graph(document, dict(inputs), read, keep, device_graph),
            {},
        )
        assert isinstance(answer, dict)
        return answer

    async def _once(self, request_id: str, start: Any, nothing: Answer) -> Answer:
        """The answer to request ``request_id``: recorded, being made, or made now by ``start()``.

        ``nothing`` is the answer to a request forgotten (its caller gone).
        """
        answered = self._answers.get(request_id)
        if answered is not None or request_id in self._forgotten:
            await anyio.lowlevel.checkpoint()  # a checkpoint, answered or not
            return nothing if answered is None else answered  # forgotten: nothing runs
        running = self._running.get(request_id)
        if running is None:
            running = asyncio.ensure_future(start())
            self._running[request_id] = running
            running.add_done_callback(  # its record goes when it ends (after a cancelled caller)
                lambda task: (
                    self._running.pop(request_id) if self._running.get(request_id) is task else None
                )
            )
        try:
            results: Answer = await asyncio.shield(running)
        except asyncio.CancelledError:
            running.cancel()  # the caller went away: so does the work, or what it kept
            if running.done() and not running.cancelled() and running.exception() is None:
                self._drop(running.result())
            raise
        if request_id in self._forgotten:  # forgotten while it ran: nobody takes its results
            self._drop(results)
            return nothing
        self._answers[request_id] = results
        if len(self._answers) > _ANSWERS_KEPT:
            self._answers.popitem(last=False)
        return results

    async def _run(
        self,
        plan: Plan,
        arrays: list[Any],
        scalars: dict[str, Any],
        keep: bool,
        device_graph: bool,
    ) -> list[Any]:
        call = await self._call_for(plan, device_graph)
        operands = [
            self._kept_array(each) if isinstance(each, Resident) else each for each in arrays
        ]
        chained = any(isinstance(each, Resident) for each in arrays)
        if not keep and not chained:
            result = await call(*operands, **scalars)
            self.served += 1
            results = list(result) if isinstance(result, tuple | list) else [result]
            return [np.asarray(each) for each in results]
        # Results into arrays made here: in device memory off the CPU, kept or read back.
        outs = self._new_results(call, call.result_sizes(*operands, **scalars))
        await call(*operands, out=outs, **scalars)
        self.served += 1
        if not keep:
            return [await _read(each, copy=False) for each in outs]
        return [self._keep(out) for out in outs]

    async def _run_graph(
        self,
        document: LaunchGraphDocument,
        inputs: dict[int, Any],
        read: Sequence[int] | None,
        keep: bool,
        device_graph: bool | None,
    ) -> dict[int, Any]:
        run = await self._graph_for(document, device_graph)
        slots = {
            slot_id: self._kept_array(each) if isinstance(each, Resident) else each
            for slot_id, each in inputs.items()
        }
        results = await run(slots, read=read, device=keep)
        self.served += 1
        if not keep:
            return results
        return {slot_id: self._keep(each) for slot_id, each in results.items()}

    def _keep(self, array: Any) -> Resident:
        """Keep ``array`` here (a device array on CUDA, else NumPy); its handle."""
        key = uuid.uuid4().hex
        self._kept[key] = array
        return Resident(self.identity, key, array.dtype.str, int(array.size))

    def _kept_array(self, resident: Resident) -> Any:
        array = self._kept.get(resident.key) if resident.holder == self.identity else None
        if array is None:
            raise LaunchArgumentMismatch(
                f"result {resident.key} is not kept on this actor (released, or another's)",
                path="$.operands",
            )
        return array

    def _new_results(self, call: PipelineCall, sizes: Sequence[int]) -> list[Any]:
        """Empty result arrays: in device memory on CUDA, else host arrays (the device's)."""
        backend = call.backend
        dtypes = [np.dtype(shape.dtype.numpy_name) for shape in call.document.results]
        if backend.kind != "cuda":
            return [np.empty(size, dtype) for size, dtype in zip(sizes, dtypes, strict=True)]
        return [
            ArrayView.allocate(backend, dtype, size)
            for size, dtype in zip(sizes, dtypes, strict=True)
        ]

    async def _call_for(self, plan: Plan, device_graph: bool) -> PipelineCall:
        if isinstance(plan, str):
            plan = self._tuned.get(plan, plan)  # a tuned plan's name: its winning document
        if isinstance(plan, str) and plan not in BUILTIN_PLANS:
            raise LaunchArgumentMismatch(
                f"no plan named {plan!r} here: not a built-in plan ({', '.join(BUILTIN_PLANS)}) "
                "nor one tuned on or handed to this actor",
                path="$.plan",
            )
        call: PipelineCall = await self._opened(
            self._calls,
            _call_key(plan, device_graph),
            lambda backend: open_pipeline(plan, backend=backend, device_graph=device_graph),
        )
        return call

    async def _graph_for(
        self, document: LaunchGraphDocument, device_graph: bool | None
    ) -> GraphCall:
        if not isinstance(document, LaunchGraphDocument):
            raise LaunchArgumentMismatch(
                f"expected a LaunchGraphDocument, got {type(document).__name__}",
                path="$.document",
            )
        run: GraphCall = await self._opened(
            self._graphs,
            (_digest(document), device_graph),
            lambda backend: open_graph(document, backend=backend, device_graph=device_graph),
        )
        return run

    async def _opened(self, table: dict[Any, Any], key: Any, open_one: Any) -> Any:
        """``table[key]``, opened (``open_one(backend)``, entered) when first asked for."""
        async with self._lock:
            opened = table.get(key)
            if opened is None:
                opened = open_one(self._open_backend())
                await opened.__aenter__()
                table[key] = opened
            return opened

    def _open_backend(self) -> Backend:
        if self._backend is None:
            self._backend = create_backend(self._kind)
        return self._backend

    async def tune(
        self,
        problem: PipelineTuningProblem,
        cache: str | None = None,
        settings: TuningSettings | None = None,
    ) -> TuningResult:
        """Tune ``problem`` on this actor's device; its winner is served as ``problem.name`` here.

        ``cache``: a tuning cache file (shared safely between processes), else
        none; ``settings`` how candidates are measured (the tuner's defaults
        when ``None``). Calls already open for an earlier winner of the name
        stay open for requests that name that document.
        """
        if not isinstance(problem, PipelineTuningProblem):
            raise LaunchArgumentMismatch(
                f"an actor tunes pipeline problems, not {type(problem).__name__}",
                path="$.problem",
            )
        async with self._lock:
            backend = self._open_backend()
        async with Tuner(backend, cache=cache, settings=settings) as tuner:
            result = await tuner.tune(problem)
        if result.winner is not None:
            self._tuned[problem.name] = result.tuned_document(problem)
        return result

    async def adopt(self, name: str, document: PipelineDocument) -> None:
        """Serve ``document`` as ``name`` here (a plan another actor tuned)."""
        await anyio.lowlevel.checkpoint()
        if not isinstance(document, PipelineDocument):
            raise LaunchArgumentMismatch(
                f"expected a PipelineDocument, got {type(document).__name__}", path="$.document"
            )
        self._tuned[name] = document

    async def tuned_plans(self) -> list[str]:
        """The names of the plans tuned here or handed over."""
        await anyio.lowlevel.checkpoint()
        return sorted(self._tuned)

    async def fetch(self, keys: Sequence[str]) -> list[np.ndarray[Any, Any]]:
        """Copies of the results kept here under ``keys``, as NumPy arrays (they stay kept)."""
        await anyio.lowlevel.checkpoint()  # a checkpoint, whatever there is to read
        arrays = [self._kept.get(key) for key in keys]
        missing = [key for key, array in zip(keys, arrays, strict=True) if array is None]
        if missing:
            raise LaunchArgumentMismatch(f"results not kept here: {', '.join(missing)}")
        return [await _read(array, copy=True) for array in arrays]

    async def forget(self, request_id: str) -> int:
        """Drop request ``request_id``: its run if still going, what it kept, its answer.

        For a router whose caller was cancelled after sending the request; how
        many kept results were let go.
        """
        await anyio.lowlevel.checkpoint()
        self._forgotten[request_id] = None  # it may not have started yet: refuse it then
        if len(self._forgotten) > _ANSWERS_KEPT:
            self._forgotten.popitem(last=False)
        running = self._running.get(request_id)
        if running is not None:
            running.cancel()
        return self._drop(self._answers.pop(request_id, []))

    def _drop(self, results: Answer) -> int:
        """Let go of the kept results among ``results``; how many were kept."""
        values = results.values() if isinstance(results, dict) else results
        return self._let_go([each.key for each in values if isinstance(each, Resident)])

    async def release(self, keys: Sequence[str]) -> int:
        """Let the results kept under ``keys`` go (their memory once their work is done)."""
        await anyio.lowlevel.checkpoint()
        return self._let_go(keys)

    def _let_go(self, keys: Sequence[str]) -> int:
        """Stop keeping the results under ``keys``; how many were kept.

        The open calls let go of the arrays earlier calls still hold, so a
        released result's memory goes once its work is done, not after later calls.
        """
        released = sum(self._kept.pop(key, None) is not None for key in keys)
        if released:
            for call in self._calls.values():
                call.let_go()
        return released

    async def kept(self) -> int:
        """How many results are kept here."""
        await anyio.lowlevel.checkpoint()
        return len(self._kept)

    async def holder(self) -> str:
        """The actor's :attr:`identity`: the :attr:`Resident.holder` of what it keeps."""
        await anyio.lowlevel.checkpoint()
        return self.identity

    async def warm_plans(self) -> list[str]:
        """The plans whose calls are open here (a document's by its target)."""
        await anyio.lowlevel.checkpoint()
        return sorted({call.document.pipeline.target for call in self._calls.values()})

    async def served_count(self) -> int:
        """Requests run here (see :attr:`served`)."""
        await anyio.lowlevel.checkpoint()
        return self.served

    async def in_flight(self) -> int:
        """Requests running here now."""
        await anyio.lowlevel.checkpoint()
        return sum(not task.done() for task in self._running.values())

    async def close(self) -> int:
        """Close every call, then the backend; how many objects were left alive (0).

        Results still kept are let go first.
        """
        async with self._lock:
            self._kept.clear()
            for call in self._calls.values():
                await call.__aexit__(None, None, None)
            self._calls.clear()
            for run in self._graphs.values():
                await run.__aexit__(None, None, None)
            self._graphs.clear()
            backend, self._backend = self._backend, None
            if backend is None:
                await anyio.lowlevel.checkpoint()
                return 0
            # What a cancelled call gave up is released once its stream is done with it.
            left = len(await live_after_drain(backend))
            await backend.aclose()
            return left


def _call_key(plan: Plan, device_graph: bool) -> tuple[str, bool]:
    """An actor's open call for ``plan`` (a name, or a document's JSON digest) and choice."""
    return (plan if isinstance(plan, str) else _digest(plan)), device_graph


def _digest(document: PipelineDocument | LaunchGraphDocument) -> str:
    """A document's name for an actor's open calls: its JSON's digest, once per document object."""
    digest = _digests.get((document,))
    if digest is None:
        digest = _digests.put(
            (document,), "document:" + hashlib.sha256(encode_json(document)).hexdigest()
        )
    return digest


_digests: IdentityCache[str] = IdentityCache(64)


async def _read(array: Any, *, copy: bool) -> np.ndarray[Any, Any]:
    """A result array as NumPy: a host array as it is (or a copy), a device one read back."""
    if isinstance(array, np.ndarray):
        await anyio.lowlevel.checkpoint()
        return array.copy() if copy else array
    view: ArrayView = array
    return await download(view.backend, view.buffer, view.dtype, view.size, stream=view.live_stream)


PipelineActor: Any = ray.remote(PipelineActorImpl)
"""The Ray actor class: ``PipelineActor.options(num_gpus=1).remote()`` on a GPU node."""


@dataclass
class _Seat:
    """One actor as the router sees it."""

    actor: Any
    slots: anyio.Semaphore
    warm: set[tuple[str, Any]] = field(default_factory=set)
    load: int = 0
    """Requests sent here and not answered yet (waiting for a slot, or running)."""
    alive: bool = True


class Router:
    """Sends requests to actors: warm ones first, then the least loaded; see the module."""

    def __init__(self, actors: Sequence[Any], *, max_in_flight: int = DEFAULT_IN_FLIGHT) -> None:
        if not actors:
            raise ValueError("a router needs at least one actor")
        self._seats = [_Seat(actor, anyio.Semaphore(max_in_flight)) for actor in actors]
        self._capacity = max_in_flight
        self._order = itertools.count()
        self._holders: dict[str, _Seat] = {}
        """The seat of each actor that kept a result, by the actor's identity."""
        self.retries = 0
        """Requests sent again because their actor died."""
        self._tuned: dict[str, PipelineDocument] = {}
        """The winners of :meth:`tune`, by problem name: sent with each request naming one."""

    @property
    def alive(self) -> int:
        """Actors not known to have died."""
        return sum(seat.alive for seat in self._seats)

    async def call(
        self,
        plan: Plan,
        *arrays: np.ndarray[Any, Any] | Resident,
        keep: bool = False,
        device_graph: bool = False,
        **scalars: int | float,
    ) -> list[Any]:
        """Run ``plan`` (a built-in or tuned plan's name, or a document) on some actor.

        Its results as NumPy arrays, or with ``keep`` as :class:`Resident`
        handles to results kept on the actor. A call given :class:`Resident`
        operands runs on the actor that keeps them. Raises
        :class:`~accy_async.errors.RuntimeUnavailable` once no actor is alive
        (or the one keeping an operand died); the actor's error (a user's
        mistake: a bad array, a bad scalar) as the actor raised it.
        """
        if isinstance(plan, str):  # a plan tuned through this router: sent as its document,
            plan = self._tuned.get(plan, plan)  # so any actor serves it, adopted or not
        answer = await self._route(
            _call_key(plan, device_graph),
            arrays,
            keep,
            lambda actor, request_id: actor.call.remote(
                request_id, plan, list(arrays), scalars, keep=keep, device_graph=device_graph
            ),
        )
        assert isinstance(answer, list)
        return answer

    async def call_graph(
        self,
        document: LaunchGraphDocument,
        inputs: dict[int, np.ndarray[Any, Any] | Resident],
        *,
        read: Sequence[int] | None = None,
        keep: bool = False,
        device_graph: bool | None = None,
    ) -> dict[int, Any]:
        """Run the launch graph of ``document`` on some actor; see :func:`accy_async.open_graph`.

        ``inputs`` gives arrays for slots (``{slot_id: array}``); the slots
        ``read`` (by default each kernel's output slot) come back as NumPy
        arrays, or with ``keep`` as :class:`Resident` handles. Routed, retried
        and answered once as :meth:`call` is.
        """
        slots = dict(inputs)
        reads = None if read is None else list(read)
        answer = await self._route(
            (_digest(document), device_graph),
            list(slots.values()),
            keep,
            lambda actor, request_id: actor.call_graph.remote(
                request_id, document, slots, reads, keep=keep, device_graph=device_graph
            ),
        )
        assert isinstance(answer, dict)
        return answer

    async def tune(
        self,
        problem: PipelineTuningProblem,
        *,
        cache: str | None = None,
        settings: TuningSettings | None = None,
    ) -> TuningResult:
        """Tune ``problem`` on one actor; every actor then serves its winner as ``problem.name``.

        Requests through this router that name the problem
        (``router.call(problem.name, ...)``) then carry the winning document,
        so every actor runs it, one started since included; the other actors
        are also handed it (:meth:`PipelineActorImpl.adopt`), for requests by
        name from other routers, as far as they are alive. ``cache`` is the
        tuning cache file the tuning actor uses (see
        :class:`~accy_async.tuning.TuningCache`), ``settings`` how it
        measures. An actor that dies while tuning hands the problem to another
        (each death counted in :attr:`retries`).
        """
        while True:
            seat = self._choose((problem.name, False))  # none left alive: RuntimeUnavailable
            try:
                result: TuningResult = await self._send(
                    seat, lambda seat=seat: seat.actor.tune.remote(problem, cache, settings)
                )
            except _Died as died:
                self.retries += died.sent
                continue
            break
        if result.winner is not None:
            document = self._tuned[problem.name] = result.tuned_document(problem)
            for other in self._seats:
                if other is not seat and other.alive:
                    with contextlib.suppress(_Died):  # died: it serves nothing now
                        await self._send(
                            other,
                            lambda other=other: other.actor.adopt.remote(problem.name, document),
                        )
        return result

    async def _route(
        self, warm_key: tuple[str, Any], operands: Sequence[Any], keep: bool, send: Any
    ) -> Answer:
        """``send(actor, request_id)``'s answer from a chosen actor, sent again if it dies.

        The actor keeping :class:`Resident` operands, if any, else a warm one
        with room, else the least loaded. The request keeps one id however
        often it is sent; with ``keep``, the actor is told to forget it if the
        caller is cancelled after it went (what it kept goes too).
        """
        request_id = uuid.uuid4().hex
        holder = await self._holder_of(operands)
        while True:
            seat = holder or self._choose(warm_key)
            actor = seat.actor
            try:
                answer: Answer = await self._send(
                    seat,
                    lambda actor=actor: send(actor, request_id),
                    forget=(lambda actor=actor: actor.forget.remote(request_id)) if keep else None,
                )
            except _Died as died:
                if holder is not None:
                    raise _lost() from None
                self.retries += died.sent
                continue  # the same id, another actor: answered once
            seat.warm.add(warm_key)
            for result in answer.values() if isinstance(answer, dict) else answer:
                if isinstance(result, Resident):
                    self._holders[result.holder] = seat
            return answer

    async def fetch(self, *residents: Resident) -> list[np.ndarray[Any, Any]]:
        """The kept results as NumPy arrays, in order (they stay kept)."""
        await anyio.lowlevel.checkpoint()  # a checkpoint, whatever there is to fetch
        fetched: dict[Resident, np.ndarray[Any, Any]] = {}
        for seat, group in await self._by_holder(residents):
            keys = [each.key for each in group]
            try:
                arrays = await self._send(
                    seat, lambda seat=seat, keys=keys: seat.actor.fetch.remote(keys)
                )
            except _Died:
                raise _lost() from None
            fetched.update(zip(group, arrays, strict=True))
        return [fetched[each] for each in residents]

    async def release(self, *residents: Resident) -> int:
        """Let the kept results go; how many were still kept (an actor that died has none)."""
        await anyio.lowlevel.checkpoint()  # a checkpoint, whatever there is to release
        released = 0
        for seat, group in await self._by_holder(residents, strict=False):
            keys = [each.key for each in group]
            with contextlib.suppress(_Died):  # died: it keeps nothing now
                released += await self._send(
                    seat, lambda seat=seat, keys=keys: seat.actor.release.remote(keys)
                )
        return released

    async def _send(self, seat: _Seat, send: Any, *, forget: Any = None) -> Any:
        """``send()``'s answer from ``seat``'s actor, within its slots.

        An actor Ray calls unavailable for the moment is asked again; one that
        died raises :class:`_Died`; the actor's error comes out as
        :func:`_cause` gives it.
        """
        while True:
            seat.load += 1  # counted from the choice: the next request sees it
            try:
                async with seat.slots:
                    if not seat.alive:
                        raise _Died(sent=False)
                    return await _remote(send(), forget=forget)
            except ray.exceptions.ActorUnavailableError:
                await anyio.sleep(_UNAVAILABLE_RETRY_S)  # the same request, the same actor
            except ray.exceptions.RayActorError:
                seat.alive = False
                raise _Died(sent=True) from None
            except ray.exceptions.RayTaskError as error:
                raise _cause(error) from None
            finally:
                seat.load -= 1

    async def _holder_of(self, arrays: Sequence[Any]) -> _Seat | None:
        """The seat of the actor keeping the :class:`Resident` operands, if any."""
        holders = {each.holder for each in arrays if isinstance(each, Resident)}
        if not holders:
            return None
        if len(holders) > 1:
            raise LaunchArgumentMismatch(
                "kept results of different actors cannot meet in one call: fetch all but "
                "one actor's first",
                path="$.operands",
            )
        return await self._seat_of(holders.pop())

    async def _seat_of(self, holder: str, *, strict: bool = True) -> _Seat:
        seat = self._holders.get(holder)
        if seat is None:  # kept through another router: ask the actors their names
            for each in self._seats:
                if each.alive and each not in self._holders.values():
                    with contextlib.suppress(ray.exceptions.RayActorError):
                        self._holders[await _remote(each.actor.holder.remote())] = each
            seat = self._holders.get(holder)
        if seat is None:
            raise LaunchArgumentMismatch(
                f"a result kept by actor {holder}, which is not among this router's",
                path="$.operands",
            )
        if strict and not seat.alive:
            raise _lost()
        return seat

    async def _by_holder(
        self, residents: Sequence[Resident], *, strict: bool = True
    ) -> list[tuple[_Seat, list[Resident]]]:
        groups: dict[str, list[Resident]] = {}
        for each in residents:
            groups.setdefault(each.holder, []).append(each)
        seats = [
            (await self._seat_of(holder, strict=strict), group) for holder, group in groups.items()
        ]
        return [(seat, group) for seat, group in seats if seat.alive]

    def _choose(self, warm_key: tuple[str, Any]) -> _Seat:
        alive = [seat for seat in self._seats if seat.alive]
        if not alive:
            raise RuntimeUnavailable("every actor of the router has died")
        # A warm actor with room first (its kernels are loaded); else the least loaded.
        warm = [seat for seat in alive if warm_key in seat.warm and seat.load < self._capacity]
        start = next(self._order) % len(alive)  # ties go round the actors
        candidates = warm or alive
        return min(
            candidates,
            key=lambda seat: (seat.load, (alive.index(seat) - start) % len(alive)),
        )


class _Died(Exception):
    """The actor chosen for a request has died (the router's own signal).

    ``sent``: whether the request had reached it (else it died while the
    request waited for a slot).
    """

    def __init__(self, *, sent: bool) -> None:
        super().__init__()
        self.sent = sent


def _lost() -> RuntimeUnavailable:
    return RuntimeUnavailable("the actor keeping a result this call needs has died")


def _cause(error: Any) -> BaseException:
    """The actor's own error where it is accy-async's (a user's mistake), else Ray's."""
    cause = error.as_instanceof_cause()
    return cause if isinstance(cause, AccyError) else error


async def _remote(ref: Any, *, forget: Any = None) -> Any:
    """Await a Ray object reference; cancelled, the remote task is cancelled too.

    ``forget()``, if given, is sent then as well (the actor drops what the
    request kept, should it have finished before the cancellation reached it).
    """
    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        if forget is not None:
            forget()
        raise
