"""What a high-level call takes in, checked before anything runs: arrays and scalars.

:class:`Intake` checks a call's operands (count, dtype, shape; NumPy arrays,
other libraries' device arrays, host memory offered through DLPack), works
out its runtime scalars (given by name, or the length of an operand the plan
sizes by one) and what they decide, and finds where the results land
(``out=``'s arrays, checked, or new ones of the operands' kind). Used by
:class:`~accy_async.call.PipelineCall`; every refusal is a
:class:`LaunchArgumentMismatch` naming the array or scalar.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from .arrays import ArrayView
from .backends import Backend, StreamHandle
from .dlpack import DLPackView
from .errors import LaunchArgumentMismatch
from .interop import DeviceArray, cpu_array, device_array, empty_like
from .pipeline import PipelineArtifactPool, Resolution, resolve_launch
from .plan import DType, Forward, PipelineBuffer, PipelineDocument, ScalarArgument, resolve_quantity
from .plan._base import Tagged

__all__ = ["Array", "Intake", "plain_scalar", "refuse_device_arrays", "scalar_key"]

Array = np.ndarray[Any, Any] | DeviceArray
"""An operand or result as checked: a NumPy array, or another library's device array."""

_NUMPY_DTYPES: Final = {dtype: np.dtype(dtype.numpy_name) for dtype in DType}
"""Each plan dtype's NumPy dtype (bf16 as its uint16 storage)."""

_RESOLUTIONS_KEPT: Final = 256
"""Distinct scalar values whose typing and sizes a call remembers (the oldest goes first)."""


class Intake:
    """A call's arguments checked against one plan document; what its scalars decide, cached."""

    def __init__(self, document: PipelineDocument) -> None:
        self.document = document
        self._names = document.runtime_scalar_names or tuple(
            f"arg{index}" for index in range(document.pipeline.runtime_scalar_argument_count)
        )
        """The runtime scalars' names (``arg0``, ``arg1``, ... where the plan names none)."""
        self._known = frozenset(self._names)
        self._operand_labels = [
            (f"operand {index} ({shape.name!r})", f"$.operands[{index}]")
            for index, shape in enumerate(document.operands)
        ]
        """What an error calls each operand, and its path (made once, not per call)."""
        self._result_labels = [
            (f"result {index} ({shape.name!r})", f"$.out[{index}]")
            for index, shape in enumerate(document.results)
        ]
        self._operand_dtypes = [_numpy_dtype(shape) for shape in document.operands]
        self._result_dtypes = [_numpy_dtype(shape) for shape in document.results]
        self._sized_by = [
            [
                position
                for position, shape in enumerate(document.operands)
                if isinstance(shape.extent, Forward) and shape.extent.argument_index == index
            ]
            for index in range(len(self._names))
        ]
        """For each runtime scalar, the operands whose length it is."""
        self._resolutions: dict[
            tuple[tuple[type, Any], ...], tuple[Resolution, tuple[int, ...], tuple[int, ...]]
        ] = {}

    def operands(self, operands: Sequence[Any]) -> list[Array]:
        """The operands, checked against the plan's (count, dtype, shape)."""
        shapes = self.document.operands
        if len(operands) != len(shapes):
            names = ", ".join(shape.name for shape in shapes)
            raise LaunchArgumentMismatch(
                f"{self.document.pipeline.target!r} takes {len(shapes)} operands ({names}), "
                f"got {len(operands)}",
                path="$.operands",
            )
        return [
            _checked(array, dtype, *label)
            for array, dtype, label in zip(
                operands, self._operand_dtypes, self._operand_labels, strict=True
            )
        ]

    def scalars(
        self,
        pool: PipelineArtifactPool,
        arrays: Sequence[Array],
        given: Mapping[str, ScalarArgument | int | float | np.generic],
    ) -> tuple[Resolution, tuple[int, ...]]:
        """What the runtime scalars decide, and how many elements each result takes.

        A scalar is given by name, or is the length of an operand the plan sizes by it.
        """
        names = self._names
        if given and not self._known.issuperset(given):
            unknown = sorted(set(given) - self._known)
            raise LaunchArgumentMismatch(
                f"no runtime scalar named {unknown[0]!r}; the plan has {', '.join(names)}",
                path="$.runtime_scalar_arguments",
            )
        values: list[ScalarArgument | int | float] = []
        for index, name in enumerate(names):
            if name in given:
                values.append(plain_scalar(given[name]))
                continue
            sized = self._sized_by[index]
            if not sized:
                raise LaunchArgumentMismatch(
                    f"runtime scalar {name!r} is not the length of an operand: pass {name}=...",
                    path=f"$.runtime_scalar_arguments[{index}]",
                )
            length = arrays[sized[0]].size
            if any(arrays[position].size != length for position in sized):
                operands = self.document.operands
                described = ", ".join(
                    f"{operands[position].name} has {arrays[position].size}" for position in sized
                )
                raise LaunchArgumentMismatch(
                    f"operands sized by {name!r} differ in length ({described})",
                    path="$.operands",
                )
            if length == 0:
                raise LaunchArgumentMismatch(
                    f"operand {self.document.operands[sized[0]].name!r} is empty",
                    path="$.operands",
                )
            values.append(length)
        resolution, needs, counts = self._resolved(pool, values)
        for index, (array, shape, needed) in enumerate(
            zip(arrays, self.document.operands, needs, strict=True)
        ):
            if array.size < needed:
                raise LaunchArgumentMismatch(
                    f"operand {index} ({shape.name!r}) has {array.size} elements, "
                    f"the launch needs {needed}",
                    path=f"$.operands[{index}]",
                )
        return resolution, counts

    def _resolved(
        self, pool: PipelineArtifactPool, values: Sequence[ScalarArgument | int | float]
    ) -> tuple[Resolution, tuple[int, ...], tuple[int, ...]]:
        """What the scalars decide, and the elements each operand and result needs.

        Cached by value (:func:`resolve_launch` caches per pipeline too, but keyed by
        typed scalars only). The key holds each value's type, so ``5`` and ``5.0``
        (equal, one hash) are checked apart, and a float's sign, so ``-0.0`` stays ``-0.0``.
        """
        key = tuple([scalar_key(value) for value in values])
        cached = self._resolutions.get(key)
        if cached is not None:
            return cached
        resolution = resolve_launch(pool, values)
        arguments = resolution.arguments
        document = self.document
        cached = (
            resolution,
            tuple(resolve_quantity(shape.extent, arguments) for shape in document.operands),
            tuple(resolve_quantity(shape.extent, arguments) for shape in document.results),
        )
        self._resolutions[key] = cached
        if len(self._resolutions) > _RESOLUTIONS_KEPT:
            del self._resolutions[next(iter(self._resolutions))]
        return cached

    def results(
        self,
        backend: Backend,
        out: Any,
        counts: Sequence[int],
        operands: Sequence[Array],
        stream: StreamHandle | None,
    ) -> list[Array]:
        """Where the results land: ``out``'s arrays (checked), or new ones of the operands' kind.

        New ones are allocated for use on ``stream`` when the caller named one.
        """
        shapes = self.document.results
        if out is None:
            model = next((each for each in operands if isinstance(each, DeviceArray)), None)
            made: list[Array] = []
            for dtype, count, (what, path) in zip(
                self._result_dtypes, counts, self._result_labels, strict=True
            ):
                if model is None:
                    made.append(np.empty(count, dtype))
                    continue
                if isinstance(model.owner, DLPackView):  # no way to make one of their kind
                    view = ArrayView.allocate(backend, dtype, count)
                    made.append(DeviceArray(view, view.address, dtype, count, False, None))
                    continue
                raw = None if stream is None else stream.__cuda_stream__()[1]
                new = empty_like(model.owner, dtype, count, what, raw)
                device = device_array(new, what, path)
                assert device is not None
                made.append(device)
            return made
        given = list(out) if isinstance(out, list | tuple) else [out]
        if len(given) != len(shapes):
            raise LaunchArgumentMismatch(
                f"out= has {len(given)} arrays, the plan has {len(shapes)} results", path="$.out"
            )
        checked = []
        for array, dtype, count, (what, path) in zip(
            given, self._result_dtypes, counts, self._result_labels, strict=True
        ):
            item = _checked(array, dtype, what, path)
            readonly = item.readonly if isinstance(item, DeviceArray) else not item.flags.writeable
            if readonly:
                raise LaunchArgumentMismatch(f"{what}: the out= array is read-only", path=path)
            if item.size < count:
                raise LaunchArgumentMismatch(
                    f"{what} has {item.size} elements, the launch needs {count}", path=path
                )
            checked.append(item)
        return checked


def plain_scalar(value: Any) -> Any:
    """A scalar as a call takes it, checked later.

    A NumPy scalar (``x.mean()``, a length as ``np.int64``) becomes the Python
    number it holds; anything else stays as it is.
    """
    if isinstance(value, np.integer | np.floating):
        return value.item()
    return value


def scalar_key(value: ScalarArgument | int | float) -> tuple[Any, ...]:
    """A scalar as a cache key: its type, its value, and for a float the sign of its zero."""
    number = value.value if isinstance(value, Tagged) else value
    if number.__class__ is float:
        return (type(value), number, math.copysign(1.0, number))
    return (type(value), number)


def refuse_device_arrays(arrays: Sequence[Array], results: Sequence[Array]) -> None:
    """Refuse device arrays (on the CPU backend, which takes NumPy arrays)."""
    for what, items in (("operand", arrays), ("result", results)):
        for index, item in enumerate(items):
            if isinstance(item, DeviceArray):
                path = f"$.operands[{index}]" if what == "operand" else f"$.out[{index}]"
                raise LaunchArgumentMismatch(
                    f"{what} {index} is a {type(item.owner).__name__} in GPU memory; "
                    "the cpu backend takes NumPy arrays",
                    path=path,
                )


def _checked(array: Any, expected: np.dtype[Any], what: str, path: str) -> Array:
    """A device array of dtype ``expected``, or a NumPy array (see :func:`_checked_array`)."""
    if isinstance(array, np.ndarray):
        return _checked_array(array, expected, what, path)
    device = device_array(array, what, path)
    if device is None:  # host memory offered through DLPack: a NumPy view of it
        return _checked_array(cpu_array(array), expected, what, path)
    if device.dtype != expected:
        raise LaunchArgumentMismatch(
            f"{what} holds {device.dtype}, the plan takes {expected}", path=path
        )
    return device


def _numpy_dtype(shape: PipelineBuffer) -> np.dtype[Any]:
    return _NUMPY_DTYPES[shape.dtype]


def _checked_array(
    array: Any, expected: np.dtype[Any], what: str, path: str
) -> np.ndarray[Any, Any]:
    """``array`` as a 1-D C-contiguous NumPy array of dtype ``expected``, or a clear error."""
    if not isinstance(array, np.ndarray):
        kind = type(array).__name__
        raise LaunchArgumentMismatch(
            f"{what} is a {kind}, not an array (NumPy, or on CUDA one with "
            "__cuda_array_interface__)",
            path=path,
        )
    if array.dtype != expected:
        raise LaunchArgumentMismatch(
            f"{what} holds {array.dtype}, the plan takes {expected} "
            f"(convert it first: array.astype(np.{expected}))",
            path=path,
        )
    if array.ndim != 1:
        raise LaunchArgumentMismatch(
            f"{what} has shape {array.shape}, the plan takes a 1-D array", path=path
        )
    if not array.flags.c_contiguous:
        raise LaunchArgumentMismatch(
            f"{what} is not contiguous (pass np.ascontiguousarray(...))", path=path
        )
    return array
