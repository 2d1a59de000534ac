"""The CUDA backend: an NVIDIA GPU through cuda-python's driver API and NVRTC.

:class:`CudaBackend` (in :mod:`._backend`) is built from parts that share one
:class:`~._device.DeviceState`: memory and the janitor thread (:mod:`._memory`),
kernel launches (:mod:`._launch`), stream marks and reads (:mod:`._marks`).
Beside them: the driver's loading and error translation (:mod:`.driver`), the
completion reactor thread (:mod:`.reactor`), NVRTC (:mod:`.nvrtc`) and its
pool of worker processes (:mod:`.compile_pool`, :mod:`.nvrtc_worker`).

What the handles' ``native`` are on this backend, for code that calls the
driver beside it: a stream's is its ``CUstream``, an event's its ``CUevent``;
a buffer's has ``address``, the device pointer (``register_external_buffer``
takes any object with one); a loaded artifact's has ``function``, the
``CUfunction``, and ``params``, the address of its packed ``void*`` argument
array as the last launch that was not prepared in advance left it (a raw
``cuLaunchKernel`` of the same arguments can reuse it).
"""

from __future__ import annotations

from ._backend import CudaBackend
from .driver import probe_cuda

__all__ = ["CudaBackend", "probe_cuda"]
