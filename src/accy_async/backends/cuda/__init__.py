"""The CUDA backend: an NVIDIA GPU through cuda-python's driver API and NVRTC.

:class:`CudaBackend` (in :mod:`._backend`) is built from parts that share one
:class:`~._device.DeviceState`: memory and the janitor thread (:mod:`._memory`),
kernel launches (:mod:`._launch`), stream marks and reads (:mod:`._marks`).
Beside them: the driver's loading and error translation (:mod:`.driver`), the
completion reactor thread (:mod:`.reactor`), NVRTC (:mod:`.nvrtc`) and its
pool of worker processes (:mod:`.compile_pool`, :mod:`.nvrtc_worker`).
"""

from __future__ import annotations

from ._backend import CudaBackend
from .driver import probe_cuda

__all__ = ["CudaBackend", "probe_cuda"]
