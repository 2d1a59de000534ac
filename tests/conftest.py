"""Shared fixtures: every async test runs on asyncio and trio; backends are parametrized."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import accy_async as accy
from accy_async.backends import auto_backend_choice

from . import kernels  # noqa: F401 - registers the test CPU kernels

GPU_AVAILABLE = auto_backend_choice()[0] == "cuda"
needs_gpu = pytest.mark.skipif(not GPU_AVAILABLE, reason="no NVIDIA GPU and driver here")


def _gpu_count() -> int:
    if not GPU_AVAILABLE:
        return 0
    from accy_async.backends.cuda.driver import initialised_driver

    return int(initialised_driver().cuDeviceGetCount()[1])


GPU_COUNT = _gpu_count()
needs_two_gpus = pytest.mark.skipif(GPU_COUNT < 2, reason=f"{GPU_COUNT} GPU(s) here, two needed")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


EVERY_LOOP = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param("trio", id="trio"),
]
"""For modules about the event loops themselves: ``anyio_backend`` over uvloop too."""


BACKEND_PARAMS = [
    pytest.param("recording", id="recording"),
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, needs_gpu]),
]
EXECUTING_BACKEND_PARAMS = BACKEND_PARAMS[1:]


@pytest.fixture(params=BACKEND_PARAMS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[accy.Backend]:
    """Every backend present: recording and CPU here, CUDA where there is a GPU."""
    async with accy.open_backend(request.param) as opened:
        yield opened


@pytest.fixture(params=EXECUTING_BACKEND_PARAMS)
async def executing_backend(request: pytest.FixtureRequest) -> AsyncIterator[accy.Backend]:
    """Every backend that really runs kernels: CPU here, CUDA where there is a GPU."""
    async with accy.open_backend(request.param) as opened:
        yield opened


@pytest.fixture
async def cpu_backend() -> AsyncIterator[accy.CpuBackend]:
    async with accy.open_backend("cpu") as opened:
        assert isinstance(opened, accy.CpuBackend)
        yield opened


@pytest.fixture
async def recording() -> AsyncIterator[accy.RecordingBackend]:
    async with accy.open_backend("recording") as opened:
        assert isinstance(opened, accy.RecordingBackend)
        yield opened
