"""Kernels the tests launch, as CPU functions and (for the GPU suite) CUDA C.

``spec(backend, name)`` gives the artifact spec of kernel ``name`` in the
format the backend prefers, so one test body runs on every backend.
"""

from __future__ import annotations

import time
from typing import Any, Final

import numpy as np

import accy_async as accy
from accy_async.plan import ArtifactFormat, ArtifactSpec, CpuKernelPayload, TextPayload

# name: (buffers, scalars, CUDA source)
KERNELS: Final[dict[str, tuple[int, int, str]]] = {
    "iota_f32": (
        1,
        2,
        """extern "C" __global__ void iota_f32(float* out, unsigned n, float base) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = base + (float)i;
        }""",
    ),
    "copy_f32": (
        2,
        1,
        """extern "C" __global__ void copy_f32(float* out, const float* in, unsigned n) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = in[i];
        }""",
    ),
    "add_f32": (
        3,
        1,
        """extern "C" __global__ void add_f32(float* out, const float* a, const float* b,
                                             unsigned n) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = a[i] + b[i];
        }""",
    ),
    "slow_fill_f32": (
        1,
        3,
        """extern "C" __global__ void slow_fill_f32(float* out, unsigned n, float value,
                                                   unsigned long long spin_ns) {
            unsigned long long start;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
            unsigned long long now = start;
            while (now - start < spin_ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = value;
        }""",
    ),
    "out_of_bounds": (
        1,
        0,
        """extern "C" __global__ void out_of_bounds(float* out) {
            volatile float* far = (float*)0x10;
            *far = out[0];
        }""",
    ),
}


@accy.cpu_kernel("tests.iota_f32")
def iota_f32(ctx: accy.CpuLaunchContext, out: np.ndarray, n: int, base: float) -> None:
    out.view(np.float32)[:n] = base + np.arange(n, dtype=np.float32)


@accy.cpu_kernel("tests.copy_f32")
def copy_f32(ctx: accy.CpuLaunchContext, out: np.ndarray, src: np.ndarray, n: int) -> None:
    out.view(np.float32)[:n] = src.view(np.float32)[:n]


@accy.cpu_kernel("tests.add_f32")
def add_f32(
    ctx: accy.CpuLaunchContext, out: np.ndarray, a: np.ndarray, b: np.ndarray, n: int
) -> None:
    out.view(np.float32)[:n] = a.view(np.float32)[:n] + b.view(np.float32)[:n]


@accy.cpu_kernel("tests.slow_fill_f32")
def slow_fill_f32(
    ctx: accy.CpuLaunchContext, out: np.ndarray, n: int, value: float, spin_ns: int
) -> None:
    time.sleep(spin_ns / 1e9)
    out.view(np.float32)[:n] = value


@accy.cpu_kernel("tests.out_of_bounds")
def out_of_bounds(ctx: accy.CpuLaunchContext, out: np.ndarray) -> None:
    out.view(np.float32)[out.size] = 1.0  # IndexError: the CPU's "illegal address"


def spec(backend: accy.Backend, name: str, **changes: Any) -> ArtifactSpec:
    """The spec of test kernel ``name`` in the backend's preferred format."""
    buffers, scalars, source = KERNELS[name]
    fmt = backend.preferred_formats[0]
    payload: Any
    if fmt is ArtifactFormat.CPU:
        payload = CpuKernelPayload(f"tests.{name}")
    else:
        fmt = ArtifactFormat.CUDA_SOURCE if ArtifactFormat.CUDA_SOURCE in backend.formats else fmt
        payload = TextPayload(source)
    fields: dict[str, Any] = {
        "kernel_name": name,
        "format": fmt,
        "payload": payload,
        "argument_count": buffers + scalars,
        "scalar_argument_count": scalars,
    }
    fields.update(changes)
    return ArtifactSpec(**fields)


async def load(backend: accy.Backend, name: str) -> accy.LoadedArtifact:
    """Create and load test kernel ``name``."""
    return await backend.load_artifact(await backend.create_artifact(spec(backend, name)))


def grid_for(n: int, block: int = 128) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A 1-D grid and block covering ``n`` elements."""
    return (max(1, -(-n // block)), 1, 1), (block, 1, 1)
