"""Kernels the tests launch, as CPU functions and (for the GPU suite) CUDA C.

``spec(backend, name)`` gives the artifact spec of kernel ``name`` in the
format the backend prefers, so one test body runs on every backend.
"""

from __future__ import annotations

import threading
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
    "add_one_f32": (
        2,
        1,
        """extern "C" __global__ void add_one_f32(float* out, const float* in, unsigned n) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = in[i] + 1.0f;
        }""",
    ),
    "count_fill_u32": (
        2,
        1,
        """extern "C" __global__ void count_fill_u32(unsigned* out, const unsigned* count,
                                                    unsigned value) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < count[0]) out[i] = value;
        }""",
    ),
    "scalar_count_fill_u32": (
        1,
        2,
        """extern "C" __global__ void scalar_count_fill_u32(unsigned* out, unsigned n,
                                                           unsigned value) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = value;
        }""",
    ),
    "block_probe": (
        1,
        0,
        """extern "C" __global__ void block_probe(unsigned* out) {
            if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = blockDim.x;
        }""",
    ),
    "gate": (1, 0, ""),
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


@accy.cpu_kernel("tests.add_one_f32")
def add_one_f32(ctx: accy.CpuLaunchContext, out: np.ndarray, src: np.ndarray, n: int) -> None:
    out.view(np.float32)[:n] = src.view(np.float32)[:n] + 1.0


@accy.cpu_kernel("tests.count_fill_u32")
def count_fill_u32(
    ctx: accy.CpuLaunchContext, out: np.ndarray, count: np.ndarray, value: int
) -> None:
    n = int(count.view(np.uint32)[0])
    out.view(np.uint32)[:n] = value


@accy.cpu_kernel("tests.scalar_count_fill_u32")
def scalar_count_fill_u32(ctx: accy.CpuLaunchContext, out: np.ndarray, n: int, value: int) -> None:
    out.view(np.uint32)[:n] = value


@accy.cpu_kernel("tests.block_probe")
def block_probe(ctx: accy.CpuLaunchContext, out: np.ndarray) -> None:
    time.sleep(abs(ctx.block[0] - 64) * 20e-6)  # 64 threads is the fastest candidate
    out.view(np.uint32)[0] = ctx.block[0]


GATE = threading.Event()
"""Held shut by a test, ``tests.gate`` kernels block their stream until it opens."""


@accy.cpu_kernel("tests.gate")
def gate(ctx: accy.CpuLaunchContext, out: np.ndarray) -> None:
    if not GATE.wait(timeout=60):
        raise TimeoutError("the test never opened the gate")


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


TUNE_PROBE_CALLS: list[int] = [0]
"""How many times ``tests.tune_probe`` ran (tests of shared tuning runs read it)."""


@accy.cpu_kernel("tests.tune_probe")
def tune_probe(ctx: accy.CpuLaunchContext, out: np.ndarray, n: int) -> None:
    """Fastest at block 128 without ``-DSLOW``; ``-DHANG`` blocks on :data:`GATE`."""
    TUNE_PROBE_CALLS[0] += 1
    if ctx.define("HANG", 0) and not GATE.wait(timeout=60):
        raise TimeoutError("the test never opened the gate")
    steps = abs(ctx.block[0].bit_length() - 8) + 2 * ctx.define("SLOW", 0)  # 128 has 8 bits
    time.sleep((1 + steps) * 400e-6)
    out.view(np.uint32)[0] = ctx.block[0]
