"""The recording backend: counts, ids, handle checks and fault injection."""

from __future__ import annotations

import pickle

import pytest

import accy_async as accy
from accy_async.backends.recording import FAULT_KINDS

from .kernels import load


async def test_ids_count_up_from_one_and_destroys_are_remembered() -> None:
    async with accy.open_backend("recording") as backend:
        assert isinstance(backend, accy.RecordingBackend)
        a, b = backend.allocate_buffer(16), backend.allocate_buffer(32)
        assert (a.id, b.id) == (1, 2)  # 0 is the default stream
        assert backend.allocated_buffer_ids == [1, 2]
        assert backend.allocated_buffer_byte_sizes == [16, 32]
        backend.destroy(b)
        backend.destroy(a)
        assert backend.destroy_count == 2
        assert backend.last_destroyed_id == 1
        assert backend.destroyed_ids == [2, 1]


async def test_fail_after_lets_n_calls_through_then_fails_every_later_one() -> None:
    backend = accy.RecordingBackend(fail_after={"allocate": 1})
    first = backend.allocate_buffer(16)
    for _ in range(2):
        with pytest.raises(accy.OutOfDeviceMemory, match="injected fault: allocate call 2"):
            backend.allocate_buffer(16)
    assert backend.buffer_allocate_count == 1
    backend.destroy(first)
    await backend.aclose()


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("load", accy.RuntimeUnavailable),
        ("create", accy.InvalidArtifact),
        ("launch", accy.RuntimeUnavailable),
        ("stream", accy.RuntimeUnavailable),
        ("event", accy.RuntimeUnavailable),
        ("fill", accy.UnsupportedOperation),
    ],
)
async def test_each_kind_fails_with_the_error_the_seed_names(
    kind: accy.backends.FaultKind, error: type[accy.AccyError]
) -> None:
    backend = accy.RecordingBackend()
    backend.inject_fault(kind)
    buffer = backend.allocate_buffer(64)

    async def call() -> None:
        if kind in ("load", "create", "launch"):
            kernel = await load(backend, "iota_f32")
            backend.launch(
                kernel,
                [buffer.bind()],
                [accy.U32(1), accy.F32(0)],
                accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
            )
        elif kind == "stream":
            backend.create_stream()
        elif kind == "event":
            backend.create_event()
        else:
            backend.fill_buffer(buffer, 0)

    with pytest.raises(error):
        await call()
    # A one-shot fault fires once; the next call of that kind goes through.
    assert backend.faults_fired(kind) == 1
    backend.clear_faults()
    backend.destroy_all(backend.live_handles())
    await backend.aclose()


async def test_custom_errors_and_a_query_fault_poison_the_backend() -> None:
    backend = accy.RecordingBackend()
    backend.inject_fault("query", error=accy.DeviceFault)
    event = backend.create_event()
    with pytest.raises(accy.DeviceFault):
        backend.query_event(event)
    assert backend.fault is not None
    with pytest.raises(accy.DeviceFault):
        backend.create_stream()
    backend.destroy(event)
    await backend.aclose()


async def test_manual_completion_holds_work_until_completed() -> None:
    backend = accy.RecordingBackend(completion="manual")
    event = backend.create_event()
    stream = backend.create_stream()
    backend.record_event(event, stream)
    fired: list[object] = []
    backend.notify_when_complete(event, fired.append)
    assert not backend.query_event(event)
    assert not backend.query_stream(stream)
    assert backend.pending_count() == 1
    backend.complete_all()
    assert fired == [None]
    assert backend.query_stream(stream)
    for obj in (event, stream):
        backend.destroy(obj)
    await backend.aclose()


async def test_unknown_fault_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        accy.RecordingBackend().inject_fault("explode")  # type: ignore[arg-type]
    assert "allocate" in FAULT_KINDS


def test_errors_pickle_with_their_path_and_render_it() -> None:
    error = accy.LaunchArgumentMismatch("too few", path="$.operands")
    assert str(error) == "too few - at `$.operands`"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is accy.LaunchArgumentMismatch
    assert (copy.message, copy.path) == ("too few", "$.operands")
    log_error = accy.CompilationError("nvrtc failed", log="line 1: error")
    assert "line 1: error" in str(log_error)
    assert pickle.loads(pickle.dumps(log_error)).log == "line 1: error"
    assert issubclass(accy.PlanError, ValueError)
    assert issubclass(accy.LimitExceeded, accy.LaunchArgumentMismatch)
    assert issubclass(accy.BackendClosed, accy.RuntimeUnavailable)
