"""DLPack both ways: others' tensors taken (:func:`consume`), ours offered (:func:`export`).

:func:`consume` calls ``obj.__dlpack__`` (asking for a versioned capsule, DLPack
1.x, and falling back to the legacy one), takes ownership of the managed
tensor as the protocol says (the capsule is renamed ``used_...``) and
returns a :class:`DLPackView`. The producer's memory stays valid until the view
is released (:meth:`DLPackView.release`, or when the view is collected), which
calls the producer's deleter exactly once.

:func:`export` builds the managed tensor for memory another object owns and
wraps it in a capsule; the owner stays referenced until the consumer calls the
deleter (or, for a capsule dropped unconsumed, until the next :func:`sweep`).

The structures follow ``dlpack.h`` (v1.0); NumPy produces and consumes both
capsule kinds for CPU arrays, which is how this module is tested without a GPU.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

__all__ = [
    "CPU",
    "CUDA",
    "CUDA_HOST",
    "CUDA_MANAGED",
    "DLPackView",
    "consume",
    "export",
    "exported_count",
    "sweep",
]

CPU: Final = 1
CUDA: Final = 2
CUDA_HOST: Final = 3
CUDA_MANAGED: Final = 13

_READ_ONLY: Final = 1 << 0


class _Device(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _Tensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = (
        ("dl_tensor", _Tensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    )


class _Version(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class _ManagedVersioned(ctypes.Structure):
    _fields_ = (
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    )


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype = ctypes.c_int
_set_name.argtypes = (ctypes.py_object, ctypes.c_char_p)
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = (ctypes.py_object, ctypes.c_char_p)

# PyCapsule_SetName keeps the pointer: these bytes live as long as the module.
_VERSIONED: Final = b"dltensor_versioned"
_USED_VERSIONED: Final = b"used_dltensor_versioned"
_LEGACY: Final = b"dltensor"
_USED_LEGACY: Final = b"used_dltensor"

_CODES: Final = {0: "i", 1: "u", 2: "f", 6: "b"}
_KINDS: Final = {kind: code for code, kind in _CODES.items()}
_BFLOAT: Final = 4


@dataclass(eq=False)
class DLPackView:
    """A consumed DLPack tensor: where it is and what it holds. Release it once done."""

    address: int
    """The first element (``data + byte_offset``)."""
    device_type: int
    device_id: int
    dtype: np.dtype[Any]
    """The element type (``bfloat16`` is reported as ``uint16``, its storage)."""
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    """In elements; ``None``: C-contiguous."""
    readonly: bool
    bfloat16: bool = False
    _release: Any = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """How many elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        """How many bytes the elements take (contiguous)."""
        return self.size * self.dtype.itemsize

    @property
    def contiguous(self) -> bool:
        """Whether the elements are in C order with no gaps."""
        if self.strides is None:
            return True
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True

    def release(self) -> None:
        """Call the producer's deleter (once; later calls do nothing)."""
        if self._release is not None:
            self._release()


def consume(obj: Any, *, stream: int | None = None) -> DLPackView:
    """Take ``obj``'s DLPack tensor; ``stream`` is the consumer's (see the array API's rules).

    Raises :class:`TypeError` for an object without ``__dlpack__`` or with a
    capsule it does not understand, :class:`ValueError` for an element type
    with lanes (vectors) or one NumPy has no name for.
    """
    exporter = getattr(obj, "__dlpack__", None)
    if exporter is None:
        raise TypeError(f"{type(obj).__name__} has no __dlpack__")
    keywords: dict[str, Any] = {} if stream is None else {"stream": stream}
    try:
        capsule = exporter(max_version=(1, 0), **keywords)
    except TypeError:  # a producer from before DLPack 1.0
        capsule = exporter(**keywords)
    if _is_valid(capsule, _VERSIONED):
        pointer = _get_pointer(capsule, _VERSIONED)
        managed = _ManagedVersioned.from_address(pointer)
        if managed.version.major != 1:
            raise TypeError(f"DLPack {managed.version.major}.x is not understood")
        readonly = bool(managed.flags & _READ_ONLY)
        used = _USED_VERSIONED
    elif _is_valid(capsule, _LEGACY):
        pointer = _get_pointer(capsule, _LEGACY)
        managed = _Managed.from_address(pointer)  # type: ignore[assignment]
        readonly = False
        used = _USED_LEGACY
    else:
        raise TypeError(f"{type(obj).__name__}.__dlpack__ returned no DLPack capsule")
    if _set_name(capsule, used) != 0:  # ours now: the capsule no longer deletes it
        raise TypeError("the DLPack capsule could not be taken")
    release = _releaser(pointer, managed.deleter)
    try:
        view = _view(managed.dl_tensor, readonly)
    except BaseException:
        release()
        raise
    view._release = release
    weakref.finalize(view, release)
    return view


def _releaser(pointer: int, deleter: int | None) -> Any:
    lock = threading.Lock()
    done = [False]

    def release() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        if deleter:
            _Deleter(deleter)(pointer)

    return release


def _view(tensor: _Tensor, readonly: bool) -> DLPackView:
    dtype_info = tensor.dtype
    if dtype_info.lanes != 1:
        raise ValueError(f"vector element types ({dtype_info.lanes} lanes) are not supported")
    bfloat16 = dtype_info.code == _BFLOAT and dtype_info.bits == 16
    if bfloat16:
        dtype = np.dtype(np.uint16)
    else:
        kind = _CODES.get(dtype_info.code)
        if kind is None:
            raise ValueError(f"DLPack type code {dtype_info.code} is not supported")
        dtype = np.dtype(f"{kind}{max(dtype_info.bits // 8, 1)}")
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else None
    return DLPackView(
        address=(tensor.data or 0) + tensor.byte_offset,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        dtype=dtype,
        shape=shape,
        strides=strides,
        readonly=readonly,
        bfloat16=bfloat16,
    )


# ----- export ---------------------------------------------------------------------------------

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)

_UNHELD: Final = 2
"""``sys.getrefcount`` of a capsule only its export record holds (the record, the argument)."""


class _Export:
    """What an exported tensor keeps alive until its deleter runs."""

    __slots__ = ("capsule", "managed", "name", "owner", "shape")

    def __init__(self, managed: ctypes.Structure, shape: Any, owner: Any, name: bytes) -> None:
        self.managed = managed
        self.shape = shape
        self.owner = owner
        self.name = name
        self.capsule: Any = None


_exports: dict[int, _Export] = {}
"""Exported managed tensors not yet deleted, by address (the GIL guards it)."""


def _delete(pointer: int | None) -> None:
    """The deleter every exported tensor carries: lets go of its owner."""
    if pointer is not None:
        _exports.pop(pointer, None)


_DELETER: Final = _Deleter(_delete)


def sweep() -> None:
    """Forget exports whose capsule was dropped unconsumed (nobody else holds it, still named).

    A capsule destructor written in Python breaks a consumer that drops the
    capsule with its own error pending (the error is lost), so capsules have
    none: this sweep, run at each export and by the owners of exported
    memory, stands in for it.
    """
    for pointer, record in list(_exports.items()):
        if (
            record.capsule is not None
            and sys.getrefcount(record.capsule) <= _UNHELD
            and _is_valid(record.capsule, record.name)
        ):
            del _exports[pointer]


def export(
    address: int,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    device: tuple[int, int],
    owner: Any,
    *,
    versioned: bool,
    readonly: bool = False,
) -> Any:
    """A DLPack capsule over ``address`` (C-contiguous ``shape`` of ``dtype`` on ``device``).

    ``owner`` is kept referenced until the consumer calls the deleter, or,
    for a capsule dropped unconsumed, until the next :func:`sweep`. ``versioned`` makes a DLPack
    1.0 capsule (``dltensor_versioned``, for consumers that passed
    ``max_version``), else a legacy one. Raises :class:`BufferError` for an
    element type DLPack has no code for.
    """
    code = _KINDS.get(dtype.kind)
    if code is None:
        raise BufferError(f"DLPack has no type code for {dtype}")
    extents = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed: _Managed | _ManagedVersioned
    if versioned:
        managed = _ManagedVersioned()
        managed.version.major, managed.version.minor = 1, 0
        managed.flags = _READ_ONLY if readonly else 0
    else:
        managed = _Managed()
    tensor = managed.dl_tensor
    tensor.data = address or None
    tensor.device.device_type, tensor.device.device_id = device
    tensor.ndim = len(shape)
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = code, dtype.itemsize * 8, 1
    tensor.shape = ctypes.cast(extents, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None  # C-contiguous
    tensor.byte_offset = 0
    managed.deleter = ctypes.cast(_DELETER, ctypes.c_void_p).value
    pointer = ctypes.addressof(managed)
    name = _VERSIONED if versioned else _LEGACY
    sweep()
    record = _exports[pointer] = _Export(managed, extents, owner, name)
    try:
        record.capsule = _new_capsule(pointer, name, None)
    except BaseException:
        _exports.pop(pointer, None)
        raise
    return record.capsule


def exported_count() -> int:
    """How many exported tensors are still held by a consumer (or an unconsumed capsule)."""
    sweep()
    return len(_exports)
