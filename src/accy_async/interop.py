"""Other libraries' arrays: the CUDA Array Interface and DLPack, read without a copy.

A :class:`DeviceArray` is what accy-async needs of an object exposing
``__cuda_array_interface__`` (CuPy arrays, PyTorch CUDA tensors, Numba
device arrays): its address, element type and count, and the stream its
producer queues work on, which a consumer must order itself after on the
device. PyTorch does not put that stream in the interface (it exports
version 2), so for a tensor it is PyTorch's current stream on the tensor's
device. PyTorch tensors are read through their own attributes, not the
interface (building its dictionary costs more than the rest of a call's
checks together).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from . import dlpack
from .errors import LaunchArgumentMismatch

__all__ = ["DeviceArray", "Lease", "cpu_array", "device_array", "empty_like"]


@dataclass(slots=True, unsafe_hash=True)
class DeviceArray:
    """A contiguous 1-D array in device memory, owned by another library.

    Compared and hashed by its fields, as a value; treat it as read-only (it is
    not frozen: a frozen dataclass costs a microsecond to build, and a call
    builds one per array).
    """

    owner: Any
    """The caller's object: kept referenced while the device may use the memory."""
    address: int
    dtype: np.dtype[Any]
    size: int
    readonly: bool
    stream: int | None
    """The raw stream to order after (and to hand results back on); ``None``: none needed."""

    @property
    def nbytes(self) -> int:
        """The array's size in bytes."""
        return self.size * self.dtype.itemsize


class Lease:
    """The ``native`` of a buffer registered over another library's memory.

    Holding the owner keeps the memory from being freed (or reused by a
    caching allocator) until the buffer is destroyed, which happens only
    after the work using it has completed.
    """

    __slots__ = ("address", "owner")

    def __init__(self, address: int, owner: Any) -> None:
        self.address = address
        self.owner = owner


def device_array(obj: Any, what: str, path: str) -> DeviceArray | None:
    """``obj`` as a :class:`DeviceArray`, ``None`` if it has no CUDA Array Interface.

    Raises :class:`LaunchArgumentMismatch` for one that is not 1-D and
    contiguous, or whose interface cannot be read (a tensor that requires
    grad, say).
    """
    torch = sys.modules.get("torch")  # a tensor's class is loaded, so torch is imported
    if torch is not None and isinstance(obj, torch.Tensor) and obj.is_cuda:
        return _torch_device_array(torch, obj, what, path)
    try:
        interface = obj.__cuda_array_interface__
    except AttributeError:
        return _dlpack_device_array(obj, what, path)
    except Exception as exc:  # PyTorch refuses tensors that require grad, for one
        raise LaunchArgumentMismatch(f"{what}: {exc}", path=path) from exc
    dtype = _dtype_of(interface["typestr"])
    shape = tuple(interface["shape"])
    if len(shape) != 1:
        raise LaunchArgumentMismatch(
            f"{what} has shape {shape}, the plan takes a 1-D array", path=path
        )
    strides = interface.get("strides")
    if strides is not None and shape[0] > 1 and tuple(strides) != (dtype.itemsize,):
        raise LaunchArgumentMismatch(f"{what} is not contiguous", path=path)
    address, readonly = interface["data"]
    stream = interface.get("stream")  # a PyTorch tensor never gets here: read above
    return DeviceArray(
        obj,
        int(address),
        dtype,
        int(shape[0]),
        bool(readonly),
        None if stream is None else int(stream),
    )


@cache
def _dtype_of(typestr: str) -> np.dtype[Any]:
    """NumPy's element type for an interface's ``typestr`` (made once per string)."""
    return np.dtype(typestr)


def _torch_device_array(torch: Any, tensor: Any, what: str, path: str) -> DeviceArray:
    """A CUDA tensor as a :class:`DeviceArray`, from its attributes (what its interface says)."""
    if tensor.requires_grad:
        raise LaunchArgumentMismatch(
            f"{what} requires grad; pass tensor.detach() if its gradient is not needed",
            path=path,
        )
    if tensor.dim() != 1:
        raise LaunchArgumentMismatch(
            f"{what} has shape {tuple(tensor.shape)}, the plan takes a 1-D array", path=path
        )
    if not tensor.is_contiguous():
        raise LaunchArgumentMismatch(f"{what} is not contiguous", path=path)
    dtype = _torch_dtypes(torch).get(tensor.dtype)
    if dtype is None:
        raise LaunchArgumentMismatch(
            f"{what} holds {tensor.dtype}, which NumPy has no type for", path=path
        )
    return DeviceArray(
        owner=tensor,
        address=tensor.data_ptr(),
        dtype=dtype,
        size=tensor.numel(),
        readonly=False,
        stream=_torch_current_stream(torch, tensor.get_device()),
    )


@cache
def _torch_dtypes(torch: Any) -> dict[Any, np.dtype[Any]]:
    """PyTorch's element types that NumPy has too, and NumPy's for each."""
    names = (
        "float16", "float32", "float64", "bool",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    )  # fmt: skip
    table = {}
    for name in names:
        if hasattr(torch, name):
            table[getattr(torch, name)] = np.dtype(name)
    return table


@cache
def _torch_dtype_of(torch: Any, dtype: np.dtype[Any]) -> Any:
    """PyTorch's element type for NumPy's ``dtype`` (the other way round from ``_torch_dtypes``)."""
    return next(theirs for theirs, ours in _torch_dtypes(torch).items() if ours == dtype)


def _torch_current_stream(torch: Any, device: int) -> int:
    """PyTorch's current stream on ``device``, as a raw handle."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch.cuda uses inside
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _dlpack_device_array(obj: Any, what: str, path: str) -> DeviceArray | None:
    """A GPU array offered only through DLPack (JAX, cuda.core), ``None`` for anything else.

    It is exported for CUDA's legacy default stream (``stream=1``): the
    producer orders its work before that stream, and the call's lane waits
    for it on the device.
    """
    device_of = getattr(obj, "__dlpack_device__", None)
    if device_of is None or not hasattr(obj, "__dlpack__"):
        return None
    try:
        device_type = int(device_of()[0])
    except Exception as exc:
        raise LaunchArgumentMismatch(f"{what}: __dlpack_device__ failed: {exc}", path=path) from exc
    if device_type not in (dlpack.CUDA, dlpack.CUDA_MANAGED):
        return None
    try:
        view = dlpack.consume(obj, stream=_LEGACY_DEFAULT_STREAM)
    except (TypeError, ValueError, BufferError) as exc:
        raise LaunchArgumentMismatch(f"{what}: {exc}", path=path) from exc
    if len(view.shape) != 1 or not view.contiguous:
        view.release()
        raise LaunchArgumentMismatch(
            f"{what} has shape {view.shape}, the plan takes a 1-D contiguous array", path=path
        )
    return DeviceArray(
        owner=view,
        address=view.address,
        dtype=view.dtype,
        size=view.size,
        readonly=view.readonly,
        stream=_LEGACY_DEFAULT_STREAM,
    )


_LEGACY_DEFAULT_STREAM = 1


def cpu_array(obj: Any) -> Any:
    """``obj`` as a NumPy array without a copy if it offers host memory through DLPack.

    Anything else comes back as it is.
    """
    if isinstance(obj, np.ndarray) or not hasattr(obj, "__dlpack__"):
        return obj
    device_of = getattr(obj, "__dlpack_device__", None)
    if device_of is None or int(device_of()[0]) not in (dlpack.CPU, dlpack.CUDA_HOST):
        return obj
    return np.from_dlpack(obj)


def _library(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def empty_like(
    owner: Any, dtype: np.dtype[Any], count: int, what: str, stream: int | None = None
) -> Any:
    """A new 1-D array of ``count`` ``dtype`` elements from ``owner``'s library and device.

    PyTorch and CuPy are known; for another library pass ``out=``. With a raw
    ``stream``, the array is allocated for use there (both libraries' memory
    pools reuse memory in the order of the stream it was allocated on).
    """
    library = _library(owner)
    if library == "torch":
        import torch

        torch_dtype = _torch_dtype_of(torch, dtype)
        if stream is None:
            return torch.empty(count, dtype=torch_dtype, device=owner.device)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=owner.device)):
            return torch.empty(count, dtype=torch_dtype, device=owner.device)
    if library == "cupy":
        import cupy

        with owner.device:
            if stream is None:
                return cupy.empty(count, dtype=dtype)
            with cupy.cuda.ExternalStream(stream):
                return cupy.empty(count, dtype=dtype)
    raise LaunchArgumentMismatch(
        f"{what}: accy-async cannot allocate a {type(owner).__name__} result; pass out=",
        path="$.out",
    )
