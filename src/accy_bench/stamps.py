"""The device stamps the workloads measure against: kernels that stamp their end, mapped words.

A stamp kernel spins for a length of ``%globaltimer`` nanoseconds and writes its
end time to host-mapped memory (:class:`MappedStamps`), which the host sees at
once; the waits' latencies run from that stamp to the awaiting task resuming.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from accy_async import ArtifactFormat, ArtifactSpec, LaunchConfig
from accy_async.plan import TextPayload

from .rig import driver, ok

if TYPE_CHECKING:
    from accy_async import Backend, LoadedArtifact

__all__ = ["ONE", "MappedStamps", "load_spin_stamp"]

_SPIN_STAMP: Final = r"""
extern "C" __global__ void spin_stamp(volatile unsigned long long* stamp,
                                       unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *stamp = now;
    __threadfence_system();
}
"""
"""The rig's ``spin_then_stamp`` with the buffer first, as accy-async launches take them."""

_SPIN_STAMP_HIDDEN: Final = r"""
extern "C" __global__ void spin_stamp_hidden(volatile unsigned long long* stamp,
                                              const unsigned long long* length,
                                              unsigned long long unused) {
    unsigned long long start, now, ns = length[0];
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *stamp = now;
    __threadfence_system();
}
"""
"""``spin_stamp`` whose length comes from device memory: nothing in the launch predicts it."""

ONE: Final = LaunchConfig((1, 1, 1), (1, 1, 1))
"""One block of one thread: how the stamp kernels run."""


@dataclass(frozen=True, slots=True)
class _Mapped:
    """The ``native`` of an external buffer: where the device sees mapped host memory."""

    address: int


class MappedStamps:
    """Pinned host words the device writes its stamps to, each seen at once by the host."""

    def __init__(self, count: int) -> None:
        d = driver()
        flags = int(d.CU_MEMHOSTALLOC_DEVICEMAP) | int(d.CU_MEMHOSTALLOC_PORTABLE)
        self.byte_size = 8 * count
        self.host = int(ok(d.cuMemHostAlloc(self.byte_size, flags), "host alloc"))
        device = int(ok(d.cuMemHostGetDevicePointer(self.host, 0), "device pointer"))
        self.native = _Mapped(device)
        ctypes.memset(self.host, 0, self.byte_size)

    def slot(self, index: int) -> ctypes.c_uint64:
        """Stamp ``index``, read and cleared by the host."""
        return ctypes.c_uint64.from_address(self.host + 8 * index)

    def close(self) -> None:
        """Free the memory (after every backend that registered it has closed)."""
        ok(driver().cuMemFreeHost(self.host), "free host")


async def load_spin_stamp(backend: Backend, *, hidden: bool = False) -> LoadedArtifact:
    """``spin_stamp`` (or, ``hidden``, ``spin_stamp_hidden``) created and loaded on ``backend``."""
    spec = ArtifactSpec(
        kernel_name="spin_stamp_hidden" if hidden else "spin_stamp",
        format=ArtifactFormat.CUDA_SOURCE,
        payload=TextPayload(_SPIN_STAMP_HIDDEN if hidden else _SPIN_STAMP),
        argument_count=3 if hidden else 2,
        scalar_argument_count=1,
    )
    return await backend.load_artifact(await backend.create_artifact(spec))
