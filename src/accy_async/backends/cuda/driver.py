"""The CUDA driver through cuda-python: loading it, probing it, translating its errors.

Every ``CUresult`` other than success becomes an error of the accy-async tree
here, at the boundary. Sticky errors (an illegal address, a failed launch, a
hardware fault) leave the context unusable: they become
:class:`~accy_async.errors.DeviceFault`, and the backend that saw one poisons
itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any, Final

from ...errors import (
    AccyError,
    DeviceFault,
    InvalidArtifact,
    InvalidBuffer,
    LaunchArgumentMismatch,
    OutOfDeviceMemory,
    RuntimeUnavailable,
)

__all__ = ["STICKY", "driver", "initialised_driver", "libc", "libcuda", "probe_cuda", "translate"]


_driver_module: Any = None


def driver() -> Any:
    """``cuda.bindings.driver`` (imported on first use, so importing accy-async never needs it).

    Kept once imported: hot paths call this for each driver call, and an
    import statement costs more than the global read.
    """
    global _driver_module
    module = _driver_module
    if module is None:
        from cuda.bindings import driver as cuda_driver

        module = _driver_module = cuda_driver
    return module


@cache
def _codes() -> dict[str, int]:
    d = driver()
    return {
        name: int(getattr(d.CUresult, name)) for name in dir(d.CUresult) if name.startswith("CUDA_")
    }


STICKY: Final = frozenset(
    {
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_TRAP",
    }
)
"""Errors after which the context is unusable: they poison the backend."""

_OUT_OF_MEMORY: Final = frozenset({"CUDA_ERROR_OUT_OF_MEMORY"})
_ARTIFACT: Final = frozenset(
    {
        "CUDA_ERROR_INVALID_IMAGE",
        "CUDA_ERROR_INVALID_PTX",
        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        "CUDA_ERROR_NO_BINARY_FOR_GPU",
        "CUDA_ERROR_NOT_FOUND",
        "CUDA_ERROR_INVALID_SOURCE",
        "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        "CUDA_ERROR_JIT_COMPILATION_DISABLED",
        "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
    }
)
_ARGUMENTS: Final = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
    }
)
_HANDLES: Final = frozenset({"CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_ILLEGAL_STATE"})


def _error_name(code: Any) -> str:
    """``CUDA_ERROR_...`` for a ``CUresult`` (or its integer value)."""
    value = int(code)
    for name, number in _codes().items():
        if number == value:
            return name
    return f"CUresult {value}"


def translate(code: Any, action: str) -> AccyError:
    """The accy-async error for a failed ``CUresult`` of ``action``."""
    name = _error_name(code)
    message = f"{action} failed: {name}"
    if name in STICKY:
        return DeviceFault(message)
    if name in _OUT_OF_MEMORY:
        return OutOfDeviceMemory(message)
    if name in _ARTIFACT:
        return InvalidArtifact(message)
    if name in _ARGUMENTS:
        return LaunchArgumentMismatch(message)
    if name in _HANDLES:
        return InvalidBuffer(message)
    return RuntimeUnavailable(message)


@cache
def libcuda() -> ctypes.CDLL:
    """The driver library itself, for the few calls made through ctypes.

    ``cuLaunchHostFunc`` is called here directly so that the host function is
    plain C (``sem_post``): cuda-python's own wrapper takes the GIL in the
    driver's callback thread.
    """
    library = ctypes.CDLL("libcuda.so.1")
    library.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    library.cuLaunchHostFunc.restype = ctypes.c_int
    return library


def initialised_driver() -> Any:
    """``cuda.bindings.driver`` after ``cuInit``.

    Raises :class:`RuntimeUnavailable` where cuda-python or the NVIDIA driver
    is missing (a machine without a GPU), or the driver does not initialise.
    """
    try:
        d = driver()
    except ImportError as exc:
        raise RuntimeUnavailable(f"cuda-python is not installed ({exc})") from exc
    try:
        (result,) = d.cuInit(0)
    except Exception as exc:  # the driver library is missing: say so, not where it was looked for
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RuntimeUnavailable(f"no NVIDIA driver on this machine ({first_line})") from exc
    if int(result):
        raise RuntimeUnavailable(f"the CUDA driver does not initialise ({_error_name(result)})")
    return d


def probe_cuda() -> tuple[bool, str]:
    """Whether a CUDA device and driver can be used here, and why (not)."""
    try:
        d = initialised_driver()
    except RuntimeUnavailable as exc:
        return False, exc.message
    result, count = d.cuDeviceGetCount()
    if int(result) or count == 0:
        return False, "the CUDA driver sees no device"
    result, device = d.cuDeviceGet(0)
    result, raw_name = d.cuDeviceGetName(256, device)
    name = raw_name.split(b"\0", 1)[0].decode(errors="replace") if not int(result) else "?"
    return True, f"found {count} CUDA device(s); device 0 is {name}"


def libc() -> ctypes.CDLL:
    """The C library (for ``sem_t`` and ``prctl``)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
