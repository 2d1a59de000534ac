"""The raw driver rig the benchmarks share: context, stream, kernels, a mapped stamp.

``spin_then_stamp`` runs for a given number of nanoseconds of ``%globaltimer``
and writes its end time to host-mapped memory; :meth:`Rig.calibrate` relates the
GPU and host clocks, so latencies measured against the stamp exclude launch time.

The one module of ``accy_bench`` that uses the CUDA backend's helper modules
(:mod:`accy_async.backends.cuda.driver` and :mod:`~accy_async.backends.cuda.nvrtc`):
the other modules call the driver for their anchors through :func:`driver`, from
here, and use accy-async's public API for the rest.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from accy_async.backends.cuda.driver import driver, initialised_driver
from accy_async.backends.cuda.nvrtc import compile_source, nvrtc_version

__all__ = ["BATCH", "KERNELS", "Rig", "driver", "nvrtc_version", "ok", "paired_us", "run_on"]

T = TypeVar("T")

KERNELS = r"""
extern "C" __global__ void empty(float* out, const float* in, unsigned n) {}

extern "C" __global__ void spin_then_stamp(unsigned long long ns,
                                            volatile unsigned long long* stamp) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *stamp = now;
    __threadfence_system();
}
"""

BATCH = 256


def ok(result: Any, action: str) -> Any:
    """The value of a driver call's result tuple; raise if it failed."""
    code = result[0] if isinstance(result, tuple) else result
    if int(code):
        raise RuntimeError(f"{action} failed: {code}")
    if isinstance(result, tuple) and len(result) == 2:
        return result[1]
    return None


def run_on(library: str, function: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``function(*args)`` on a fresh event loop of ``library`` (uvloop is asyncio's)."""
    if library == "uvloop":
        return anyio.run(function, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(function, *args, backend=library)


class Rig:
    """A raw driver set-up for the anchors: context, stream, module, mapped stamp."""

    def __init__(self) -> None:
        d = initialised_driver()
        self.device = ok(d.cuDeviceGet(0), "cuDeviceGet")
        self.context = ok(d.cuDevicePrimaryCtxRetain(self.device), "retain")
        ok(d.cuCtxSetCurrent(self.context), "set current")
        attribute = d.CUdevice_attribute
        major = ok(
            d.cuDeviceGetAttribute(
                attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device
            ),
            "cc",
        )
        minor = ok(
            d.cuDeviceGetAttribute(
                attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device
            ),
            "cc",
        )
        self.cc = (int(major), int(minor))
        self.image = compile_source(KERNELS, "bench", (), self.cc)
        self.module = ok(d.cuModuleLoadData(self.image.image), "load")
        self.empty = ok(d.cuModuleGetFunction(self.module, b"empty"), "empty")
        self.spin = ok(d.cuModuleGetFunction(self.module, b"spin_then_stamp"), "spin")
        self.stream = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
        self.a = int(ok(d.cuMemAlloc(1024), "alloc"))
        self.b = int(ok(d.cuMemAlloc(1024), "alloc"))
        flags = d.CU_MEMHOSTALLOC_DEVICEMAP if hasattr(d, "CU_MEMHOSTALLOC_DEVICEMAP") else 2
        self.stamp_host = int(ok(d.cuMemHostAlloc(8, flags), "host alloc"))
        self.stamp_device = int(ok(d.cuMemHostGetDevicePointer(self.stamp_host, 0), "map"))
        self.stamp = ctypes.c_uint64.from_address(self.stamp_host)
        # Pre-packed arguments of `empty`.
        self.slots = (ctypes.c_uint64 * 3)(self.a, self.b, 0)
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * 3)(base, base + 8, base + 16)
        self.params = ctypes.addressof(self.pointers)
        # Arguments of `spin_then_stamp`.
        self.spin_slots = (ctypes.c_uint64 * 2)(0, self.stamp_device)
        spin_base = ctypes.addressof(self.spin_slots)
        self.spin_pointers = (ctypes.c_void_p * 2)(spin_base, spin_base + 8)
        self.spin_params = ctypes.addressof(self.spin_pointers)
        self.clock_offset = 0

    def sync(self) -> None:
        """Block until the rig's stream is idle."""
        ok(driver().cuStreamSynchronize(self.stream), "sync")

    def launch_spin(self, ns: int, stream: Any = None) -> None:
        """Launch a kernel that spins ``ns`` nanoseconds, then stamps its end."""
        self.stamp.value = 0
        self.spin_slots[0] = ns
        d = driver()
        (result,) = d.cuLaunchKernel(
            self.spin,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream if stream is not None else self.stream,
            self.spin_params,
            0,
        )
        if int(result):
            raise RuntimeError(f"launch failed: {result}")

    def calibrate(self, trials: int = 200) -> int:
        """Host minus GPU clock, plus the least time a stamp takes to reach the host.

        A zero-length kernel writes its ``%globaltimer`` to mapped memory while
        the host spins reading it; the smallest (host time seen - stamp) over
        ``trials`` is the offset. A spinning host sees the stamp within a
        microsecond or two, so latencies measured against it are, if anything,
        that much too short.
        """
        offsets = []
        for _ in range(trials):
            self.launch_spin(0)
            while self.stamp.value == 0:
                pass
            seen = time.time_ns()
            offsets.append(seen - self.stamp.value)
            self.sync()
        self.clock_offset = min(offsets)
        return self.clock_offset

    def latency_us(self, resumed_ns: int) -> float:
        """Microseconds from the last stamp to ``resumed_ns`` (a ``time.time_ns()``)."""
        return (resumed_ns - self.stamp.value - self.clock_offset) / 1e3

    def close(self) -> None:
        """Release everything the rig holds."""
        d = driver()
        d.cuStreamSynchronize(self.stream)
        d.cuMemFree(self.a)
        d.cuMemFree(self.b)
        d.cuMemFreeHost(self.stamp_host)
        d.cuModuleUnload(self.module)
        d.cuStreamDestroy(self.stream)
        d.cuDevicePrimaryCtxRelease(self.device)


async def paired_us(
    raw_batch: Callable[[], None],
    accy_batch: Callable[[], Awaitable[None]],
    sync: Callable[[], Awaitable[None]],
    repeat: int,
    launches_per_batch: int = BATCH,
) -> dict[str, float]:
    """accy-async beside the raw pre-packed launch, batches interleaved, GC paused.

    Timing the two alternately on the same kernel and stream cancels the slow
    drifts of a shared machine that separate runs would put into the ratio.
    """
    raw_samples: list[float] = []
    accy_samples: list[float] = []
    for round_index in range(repeat + 1):
        for which in ("raw", "accy"):
            gc.disable()
            start = time.perf_counter()
            if which == "raw":
                raw_batch()
            else:
                await accy_batch()
            launches = BATCH if which == "raw" else launches_per_batch
            elapsed = (time.perf_counter() - start) / launches * 1e6
            gc.enable()
            await sync()
            if round_index:  # the first round warms up
                (raw_samples if which == "raw" else accy_samples).append(elapsed)
    return {"us": statistics.median(accy_samples), "raw_us": statistics.median(raw_samples)}
