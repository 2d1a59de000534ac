"""Other libraries' streams: adopted where a stream is taken, never owned or destroyed."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import accy_async as accy
from accy_async.pipeline import (
    allocate_pipeline_intermediates,
    launch_pipeline,
    load_pipeline_artifacts,
)

from .seed_fixtures import SEED_ARGUMENTS as ARGS
from .seed_fixtures import SEED_FORMAT as PTX
from .seed_fixtures import SEED_PIPELINE, SEED_REGISTRY, seed_request


class ForeignStream:
    """What cuda.core, CuPy and newer PyTorch offer: ``__cuda_stream__() -> (0, handle)``."""

    def __init__(self, handle: int, version: int = 0) -> None:
        self.handle = handle
        self.version = version

    def __cuda_stream__(self) -> tuple[int, int]:
        return (self.version, self.handle)


class TorchStyleStream:
    """PyTorch's older spelling: a ``cuda_stream`` attribute."""

    cuda_stream = 0x7F00


async def test_a_foreign_stream_is_adopted_once_and_only_forgotten(
    recording: accy.RecordingBackend,
) -> None:
    foreign = ForeignStream(0x5000)
    adopted = recording.adopt_stream(foreign)
    assert adopted.external
    assert recording.adopt_stream(foreign) is adopted
    assert recording.adopt_stream(0x5000) is adopted  # the raw handle names the same stream
    assert recording.adopt_stream(adopted) is adopted
    assert adopted.__cuda_stream__() == (0, 0x5000)
    torch_style: Any = TorchStyleStream()
    assert recording.adopt_stream(torch_style).__cuda_stream__() == (0, 0x7F00)
    assert accy.SupportsCudaStream.__instancecheck__(foreign)
    # Not the backend's to free: left out of what it owns, no warning when it closes.
    assert adopted.id in recording.live_objects()
    assert adopted.id not in recording.live_objects(owned_only=True)
    destroyed = recording.destroy_count
    recording.destroy(adopted)
    assert recording.destroy_count == destroyed  # forgotten, not destroyed
    again = recording.adopt_stream(foreign)
    assert again is not adopted and again.external


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        ("stream 0", "str is not a stream"),
        (True, "True is not a stream"),
        (ForeignStream(1, version=3), "version 3"),
        (object(), "object is not a stream"),
    ],
)
async def test_what_is_not_a_stream_is_refused_by_name(
    recording: accy.RecordingBackend, stream: object, message: str
) -> None:
    with pytest.raises(accy.InvalidBuffer, match=message):
        recording.adopt_stream(stream)  # type: ignore[arg-type]
    with pytest.raises(accy.InvalidBuffer, match=message):
        await accy.wait_stream(recording, stream)  # type: ignore[arg-type]


async def test_a_stream_of_another_backend_is_refused(recording: accy.RecordingBackend) -> None:
    async with accy.open_backend("recording") as other:
        theirs = other.create_stream()
        with pytest.raises(accy.InvalidBuffer, match="not a live stream of this backend"):
            recording.adopt_stream(theirs)
        other.destroy(theirs)


async def test_the_cpu_backend_says_it_runs_its_own_streams() -> None:
    async with accy.open_backend("cpu") as cpu:
        with pytest.raises(accy.UnsupportedOperation, match="runs its own streams"):
            cpu.adopt_stream(ForeignStream(0x5000))
        stream = cpu.create_stream()
        with pytest.raises(TypeError, match="not a CUDA stream"):
            stream.__cuda_stream__()
        cpu.destroy(stream)


async def test_pipelines_copies_and_waits_run_on_a_foreign_stream(
    recording: accy.RecordingBackend,
) -> None:
    foreign = ForeignStream(0x6000)
    operand, result = recording.allocate_buffer(20_000), recording.allocate_buffer(20_000)
    async with (
        await load_pipeline_artifacts(recording, SEED_PIPELINE, SEED_REGISTRY, PTX) as pool,
        await allocate_pipeline_intermediates(recording, SEED_PIPELINE, ARGS) as scratch,
    ):
        request = seed_request(operand, result, scratch, pool, stream=foreign)
        for _ in range(3):  # first launch, the packing launch, a relaunch
            await launch_pipeline(recording, request)
        adopted = recording.adopt_stream(foreign)
        assert {launch.stream_id for launch in recording.launches} == {adopted.id}
        recording.write_buffer(operand, b"\x01" * 16, stream=foreign)
        await accy.wait_stream(recording, foreign)
        assert recording.query_stream(foreign)
        # Forgotten, then launched on again: adopted anew, and the relaunch follows it.
        recording.destroy(adopted)
        await launch_pipeline(recording, request)
        assert recording.launches[-1].stream_id == recording.adopt_stream(foreign).id
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        recording.destroy_all([operand, result])
