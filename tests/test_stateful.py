"""A stateful model of a backend: whatever the sequence of allocations, frees, loads,
launches, cancelled loads and injected faults, the backend's live objects are the model's.

``run_machine`` runs it outside pytest for ``docs/reliability.md``.
"""

from __future__ import annotations

import os
import warnings

import anyio
import anyio.lowlevel
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

import accy_async as accy
from accy_async import plan as p
from accy_async.backends._handles import DEFAULT_STREAM_ID
from accy_async.backends.recording import FaultKind
from accy_async.errors import AccyError
from accy_async.kernels import load_kernels
from accy_async.testing import DEFAULT_FAULT_KINDS

from .plans import artifact_plan, geometry, planned

EXAMPLES = int(os.environ.get("ACCY_STATEFUL_EXAMPLES", "40"))
RUNS = [0]


class BackendModel(RuleBasedStateMachine):
    """The model: every object the backend should hold, by id."""

    buffers = Bundle("buffers")
    loaded = Bundle("loaded")
    streams = Bundle("streams")
    events = Bundle("events")

    def __init__(self) -> None:
        super().__init__()
        self.backend = accy.RecordingBackend()
        self.model: dict[int, accy.backends.DeviceObject] = {}
        RUNS[0] += 1

    def _expect_fault(self, call: object) -> object | None:
        try:
            return call() if callable(call) else None
        except AccyError:
            return None

    @rule(target=buffers, size=st.integers(1, 1 << 20))
    def allocate(self, size: int) -> object:
        buffer = self._expect_fault(lambda: self.backend.allocate_buffer(size))
        if buffer is None:
            return multiple()
        assert isinstance(buffer, accy.BufferHandle)
        self.model[buffer.id] = buffer
        return buffer

    @rule(target=streams)
    def create_stream(self) -> object:
        stream = self._expect_fault(self.backend.create_stream)
        if stream is None:
            return multiple()
        assert isinstance(stream, accy.StreamHandle)
        self.model[stream.id] = stream
        return stream

    @rule(target=events)
    def create_event(self) -> object:
        event = self._expect_fault(self.backend.create_event)
        if event is None:
            return multiple()
        assert isinstance(event, accy.EventHandle)
        self.model[event.id] = event
        return event

    @rule(target=loaded)
    def load(self) -> object:
        spec = p.ArtifactSpec(
            kernel_name="k",
            format=p.ArtifactFormat.CUDA_PTX,
            payload=p.TextPayload(".version 8.0"),
            argument_count=1,
        )

        async def create_and_load() -> accy.LoadedArtifact:
            return await self.backend.load_artifact(await self.backend.create_artifact(spec))

        loaded = self._expect_fault(lambda: anyio.run(create_and_load))
        if loaded is None:
            return multiple()
        assert isinstance(loaded, accy.LoadedArtifact)
        self.model[loaded.id] = loaded
        return loaded

    @rule(target=buffers, buffer=consumes(buffers))
    def free_buffer(self, buffer: accy.BufferHandle) -> object:
        self.backend.destroy(buffer)
        del self.model[buffer.id]
        return multiple()

    @rule(obj=st.one_of(consumes(loaded), consumes(streams), consumes(events)))
    def destroy(self, obj: accy.backends.DeviceObject) -> None:
        self.backend.destroy(obj)
        del self.model[obj.id]

    @rule(kernel=loaded, buffer=buffers, stream=st.one_of(st.none(), streams))
    def launch(
        self,
        kernel: accy.LoadedArtifact,
        buffer: accy.BufferHandle,
        stream: accy.StreamHandle | None,
    ) -> None:
        self._expect_fault(
            lambda: self.backend.launch(
                kernel, [buffer.bind()], [], accy.LaunchConfig((1, 1, 1), (1, 1, 1)), stream=stream
            )
        )

    @rule(buffer=buffers, event=events)
    def write_and_record(self, buffer: accy.BufferHandle, event: accy.EventHandle) -> None:
        self._expect_fault(lambda: self.backend.write_buffer(buffer, b"\x01" * buffer.byte_size))
        self._expect_fault(lambda: self.backend.record_event(event))

    @rule(kind=st.sampled_from(DEFAULT_FAULT_KINDS))
    def inject_fault(self, kind: FaultKind) -> None:
        """The next call of ``kind`` fails (once)."""
        backend = self.backend
        backend.inject_fault(kind, after=backend.calls[kind])

    @rule(checkpoints=st.integers(0, 12))
    def cancelled_load(self, checkpoints: int) -> None:
        """Load a plan's kernels and cancel after a few checkpoints: nothing may stay."""
        backend = self.backend
        plan = artifact_plan(
            {1: 64},
            *(
                planned(backend, i, "block_probe", 1, launch_resources=geometry(1))
                for i in range(3)
            ),
        )

        async def attempt() -> None:
            async with anyio.create_task_group() as group:
                scope = anyio.CancelScope()

                async def load() -> None:
                    with scope, warnings.catch_warnings():
                        warnings.simplefilter("ignore", ResourceWarning)
                        try:
                            kernels = await load_kernels(backend, plan)
                        except AccyError:
                            return
                        await kernels.aclose()

                group.start_soon(load)
                for _ in range(checkpoints):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()

        anyio.run(attempt)

    @invariant()
    def live_objects_match_the_model(self) -> None:
        live = dict(self.backend.live_objects())
        live.pop(DEFAULT_STREAM_ID, None)
        assert live == {object_id: obj.kind for object_id, obj in self.model.items()}

    def teardown(self) -> None:
        self.backend.clear_faults()
        self.backend.destroy_all(self.model.values())
        anyio.run(self.backend.aclose)


def run_machine(examples: int) -> int:
    """Run the model ``examples`` times; how many runs (state machines) there were."""
    RUNS[0] = 0
    run_state_machine_as_test(
        BackendModel,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    return RUNS[0]


def test_backend_live_objects_follow_the_model() -> None:
    run_machine(EXAMPLES)
