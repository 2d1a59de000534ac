"""A graph run's stream ends as stream marks (CUDA's kind), against a backend whose marks
the test completes: released exactly once, whether seen by ``done``, by ``wait`` (with
several waiters), or never (the run dropped); a fault makes ``done`` true and ``wait``
raise."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest

import accy_async as accy
from accy_async.backends import StreamHandle, StreamMark
from accy_async.graph import launch_graph
from accy_async.kernels import load_kernels

from .plans import CHAIN_SIZES, bind_all, chain_plan, destroy_bindings, diamond


class _Mark(StreamMark):
    __slots__ = ("_backend", "callbacks", "complete", "fault", "releases")

    def __init__(self, backend: accy.Backend) -> None:
        self._backend = backend
        self.complete = False
        self.fault: accy.AccyError | None = None
        self.releases = 0
        self.callbacks: list[Any] = []

    @property
    def backend(self) -> accy.Backend:
        return self._backend

    def query(self) -> bool:
        if self.fault is not None:
            raise self.fault
        return self.complete

    def anticipate(self) -> None:
        return None

    def notify_when_complete(self, callback: Any) -> Any:
        if self.complete:
            callback(None)
        else:
            self.callbacks.append(callback)
        return _Registration(self.callbacks, callback)

    def finish(self) -> None:
        self.complete = True
        for callback in self.callbacks:
            callback(None)

    def release(self) -> None:
        self.releases += 1


class _Registration:
    def __init__(self, callbacks: list[Any], callback: Any) -> None:
        self._callbacks, self._callback = callbacks, callback

    def cancel(self) -> None:
        if self._callback in self._callbacks:
            self._callbacks.remove(self._callback)


class _MarkingBackend(accy.RecordingBackend):
    """The recording backend, marking streams for graph runs with marks the test completes
    (other waits, such as closing the kernels, have no marks, as before)."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[_Mark] = []
        self.marking = False

    def _mark_stream(self, stream: StreamHandle) -> StreamMark | None:
        if not self.marking:
            return None
        self.marks.append(_Mark(self))
        return self.marks[-1]


@pytest.fixture
async def marking() -> Any:
    backend = _MarkingBackend()
    yield backend
    await backend.aclose()


async def _run(backend: _MarkingBackend, kernels: Any, bindings: Any) -> Any:
    backend.marking = True
    try:
        return await launch_graph(kernels, bindings, diamond((0, 0, 1, 0)))
    finally:
        backend.marking = False


async def test_done_releases_the_mark_once(marking: _MarkingBackend) -> None:
    bindings = bind_all(marking, CHAIN_SIZES)
    async with await load_kernels(marking, chain_plan(marking)) as kernels:
        run = await _run(marking, kernels, bindings)
        assert len(marking.marks) == 2  # one per stream of the run
        assert not run.done and not run.node(3).done
        for mark in marking.marks:
            mark.finish()
        assert run.done and run.node(0).done and run.done
        assert [mark.releases for mark in marking.marks] == [1, 1]
        await run.wait()  # seen before: a checkpoint
        assert [mark.releases for mark in marking.marks] == [1, 1]
    destroy_bindings(marking, bindings)


async def test_every_waiter_returns_and_the_mark_is_released_once(
    marking: _MarkingBackend,
) -> None:
    bindings = bind_all(marking, CHAIN_SIZES)
    async with await load_kernels(marking, chain_plan(marking)) as kernels:
        run = await _run(marking, kernels, bindings)
        returned = []

        async def waiter(name: str) -> None:
            await run.wait()
            returned.append(name)

        async with anyio.create_task_group() as group:
            for name in ("a", "b", "c"):
                group.start_soon(waiter, name)
            await anyio.sleep(0.01)
            assert returned == []
            for mark in marking.marks:
                mark.finish()
        assert sorted(returned) == ["a", "b", "c"]
        assert [mark.releases for mark in marking.marks] == [1, 1]
    destroy_bindings(marking, bindings)


async def test_a_dropped_run_hands_its_marks_to_the_next_run(marking: _MarkingBackend) -> None:
    bindings = bind_all(marking, CHAIN_SIZES)
    async with await load_kernels(marking, chain_plan(marking)) as kernels:
        run = await _run(marking, kernels, bindings)
        dropped = list(marking.marks)
        del run
        gc.collect()
        assert [mark.releases for mark in dropped] == [0, 0]  # a finalizer takes no locks
        later = await _run(marking, kernels, bindings)
        assert [mark.releases for mark in dropped] == [1, 1]  # released on the loop's thread
        for mark in marking.marks[2:]:
            mark.finish()
        await later.wait()
    destroy_bindings(marking, bindings)


async def test_a_fault_makes_done_true_and_wait_raise(marking: _MarkingBackend) -> None:
    bindings = bind_all(marking, CHAIN_SIZES)
    async with await load_kernels(marking, chain_plan(marking)) as kernels:
        run = await _run(marking, kernels, bindings)
        for mark in marking.marks:
            mark.fault = accy.DeviceFault("the device failed")
        assert run.done
        with pytest.raises(accy.DeviceFault, match="the device failed"):
            await run.wait()
        for mark in marking.marks:
            mark.fault = None
            mark.finish()
        await run.wait()
        assert [mark.releases for mark in marking.marks] == [1, 1]
    destroy_bindings(marking, bindings)
