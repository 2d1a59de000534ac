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

from .backends import Backend, create_backend
from .call import PipelineCall, open_pipeline
from .errors import AccyError, RuntimeUnavailable
from .testing import live_after_drain

__all__ = ["DEFAULT_IN_FLIGHT", "PipelineActor", "PipelineActorImpl", "Router"]

DEFAULT_IN_FLIGHT: Final = 8
"""Requests one actor runs at once by default."""

_ANSWERS_KEPT: Final = 4096


class PipelineActorImpl:
    """What :data:`PipelineActor` runs inside Ray; plain Python, so it can be tested alone.

    The backend opens on the first request (an actor's ``__init__`` cannot
    await); the calls stay open until :meth:`close`.
    """

    def __init__(self, backend: str = "auto") -> None:
        self._kind = backend
        self._backend: Backend | None = None
        self._calls: dict[str, PipelineCall] = {}
        self._lock = asyncio.Lock()
        self._answers: OrderedDict[str, list[np.ndarray[Any, Any]]] = OrderedDict()
        self._running: dict[str, asyncio.Task[list[np.ndarray[Any, Any]]]] = {}
        self.served = 0
        """Requests run here (an answer given again from its record not counted)."""

    async def call(
        self,
        request_id: str,
        plan: str,
        arrays: Sequence[np.ndarray[Any, Any]],
        scalars: dict[str, int | float] | None = None,
    ) -> list[np.ndarray[Any, Any]]:
        """Run ``plan`` on ``arrays`` (a built-in plan's name); its results as NumPy arrays.

        A request id seen before is answered as before (from its record, or
        by awaiting the run already going), not run again.
        """
        answered = self._answers.get(request_id)
        if answered is not None:
            await anyio.lowlevel.checkpoint()  # a checkpoint, answered or not
            return answered
        running = self._running.get(request_id)
        if running is None:
            running = asyncio.ensure_future(self._run(plan, list(arrays), dict(scalars or {})))
            self._running[request_id] = running
        try:
            results = await asyncio.shield(running)
        except asyncio.CancelledError:
            running.cancel()  # the caller went away: so does the work
            raise
        finally:
            if running.done():
                self._running.pop(request_id, None)
        self._answers[request_id] = results
        if len(self._answers) > _ANSWERS_KEPT:
            self._answers.popitem(last=False)
        return results

    async def _run(
        self, plan: str, arrays: list[np.ndarray[Any, Any]], scalars: dict[str, Any]
    ) -> list[np.ndarray[Any, Any]]:
        call = await self._call_for(plan)
        result = await call(*arrays, **scalars)
        self.served += 1
        results = list(result) if isinstance(result, tuple | list) else [result]
        return [np.asarray(each) for each in results]

    async def _call_for(self, plan: str) -> PipelineCall:
        async with self._lock:
            if self._backend is None:
                self._backend = create_backend(self._kind)  # type: ignore[arg-type]
            call = self._calls.get(plan)
            if call is None:
                call = open_pipeline(plan, backend=self._backend)
                await call.__aenter__()
                self._calls[plan] = call
            return call

    async def warm_plans(self) -> list[str]:
        """The plans whose calls are open here."""
        await anyio.lowlevel.checkpoint()
        return sorted(self._calls)

    async def served_count(self) -> int:
        """Requests run here (see :attr:`served`)."""
        await anyio.lowlevel.checkpoint()
        return self.served

    async def in_flight(self) -> int:
        """Requests running here now."""
        await anyio.lowlevel.checkpoint()
        return sum(not task.done() for task in self._running.values())

    async def close(self) -> int:
        """Close every call, then the backend; how many objects the calls left alive (0)."""
        async with self._lock:
            for call in self._calls.values():
                await call.__aexit__(None, None, None)
            self._calls.clear()
            backend, self._backend = self._backend, None
            if backend is None:
                await anyio.lowlevel.checkpoint()
                return 0
            # What a cancelled call gave up is released once its stream is done with it.
            left = len(await live_after_drain(backend))
            await backend.aclose()
            return left


PipelineActor: Any = ray.remote(PipelineActorImpl)
"""The Ray actor class: ``PipelineActor.options(num_gpus=1).remote()`` on a GPU node."""


@dataclass
class _Seat:
    """One actor as the router sees it."""

    actor: Any
    slots: anyio.Semaphore
    warm: set[str] = field(default_factory=set)
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
        self.retries = 0
        """Requests sent again because their actor died."""

    @property
    def alive(self) -> int:
        """Actors not known to have died."""
        return sum(seat.alive for seat in self._seats)

    async def call(
        self, plan: str, *arrays: np.ndarray[Any, Any], **scalars: int | float
    ) -> list[np.ndarray[Any, Any]]:
        """Run ``plan`` on some actor; its results as NumPy arrays.

        Raises :class:`~accy_async.errors.RuntimeUnavailable` once no actor is
        alive; the actor's error (a user's mistake: a bad array, a bad scalar)
        as the actor raised it.
        """
        request_id = uuid.uuid4().hex
        while True:
            seat = self._choose(plan)
            seat.load += 1  # counted from the choice: the next request sees it
            try:
                async with seat.slots:
                    if not seat.alive:
                        continue
                    results: list[np.ndarray[Any, Any]] = await _remote(
                        seat.actor.call.remote(request_id, plan, list(arrays), scalars)
                    )
            except ray.exceptions.RayActorError:
                seat.alive = False
                self.retries += 1
                continue  # the same id, another actor: answered once
            except ray.exceptions.RayTaskError as error:
                cause = error.as_instanceof_cause()  # type: ignore[no-untyped-call]
                raise cause if isinstance(cause, AccyError) else error from None
            finally:
                seat.load -= 1
            seat.warm.add(plan)
            return results

    def _choose(self, plan: str) -> _Seat:
        alive = [seat for seat in self._seats if seat.alive]
        if not alive:
            raise RuntimeUnavailable("every actor of the router has died")
        # A warm actor with room first (its kernels are loaded); else the least loaded.
        warm = [seat for seat in alive if plan in seat.warm and seat.load < self._capacity]
        start = next(self._order) % len(alive)  # ties go round the actors
        candidates = warm or alive
        return min(
            candidates,
            key=lambda seat: (seat.load, (alive.index(seat) - start) % len(alive)),
        )


async def _remote(ref: Any) -> Any:
    """Await a Ray object reference; cancelled, the remote task is cancelled too."""
    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        raise
