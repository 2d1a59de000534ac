"""Element types of buffers and the typed scalar arguments kernels take."""

from __future__ import annotations

import enum
import math
from typing import Annotated, ClassVar, Final, Literal, TypeAlias

import msgspec

from ._base import Tagged, convert_plan, plan_error

__all__ = [
    "F32",
    "F32_MAX",
    "F64",
    "I32",
    "I64",
    "SCALAR_CLASSES",
    "U32",
    "U64",
    "DType",
    "ScalarArgument",
    "ScalarType",
    "integer_value",
    "scalar",
]


class DType(enum.Enum):
    """Element type of a buffer or intermediate; ``size`` is its width in bytes."""

    U8 = "u8"
    I8 = "i8"
    U16 = "u16"
    I16 = "i16"
    F16 = "f16"
    BF16 = "bf16"
    U32 = "u32"
    I32 = "i32"
    F32 = "f32"
    U64 = "u64"
    I64 = "i64"
    F64 = "f64"

    @property
    def size(self) -> int:
        """Width of one element in bytes."""
        return _DTYPE_SIZES[self]

    @property
    def numpy_name(self) -> str:
        """The NumPy dtype name of the same layout (``bf16`` is stored as ``uint16``)."""
        return _NUMPY_NAMES[self]

    @classmethod
    def from_numpy(cls, name: str) -> DType | None:
        """The element type of a NumPy dtype ``name`` (``"float32"``), ``None`` if none has it.

        ``uint16`` is ``u16``, never ``bf16``.
        """
        return _FROM_NUMPY.get(name)


_DTYPE_SIZES: Final = {
    DType.U8: 1,
    DType.I8: 1,
    DType.U16: 2,
    DType.I16: 2,
    DType.F16: 2,
    DType.BF16: 2,
    DType.U32: 4,
    DType.I32: 4,
    DType.F32: 4,
    DType.U64: 8,
    DType.I64: 8,
    DType.F64: 8,
}
_NUMPY_NAMES: Final = {
    DType.U8: "uint8",
    DType.I8: "int8",
    DType.U16: "uint16",
    DType.I16: "int16",
    DType.F16: "float16",
    DType.BF16: "uint16",
    DType.U32: "uint32",
    DType.I32: "int32",
    DType.F32: "float32",
    DType.U64: "uint64",
    DType.I64: "int64",
    DType.F64: "float64",
}
_FROM_NUMPY: Final = {
    name: dtype for dtype, name in _NUMPY_NAMES.items() if dtype is not DType.BF16
}

ScalarType: TypeAlias = Literal["u32", "i32", "u64", "i64", "f32", "f64"]

F32_MAX: Final = 3.4028234663852886e38
"""The largest finite f32: an ``F32`` holds no value of greater magnitude."""


def _check_integer(value: object, type_name: str, low: int, high: int) -> None:
    """Refuse what is not a Python ``int`` in ``[low, high]`` (msgspec checks only decodes)."""
    if type(value) is not int:
        raise plan_error(
            f"{type_name} value {value!r} is not an int"
            + (" (pass int(value))" if isinstance(value, float | str) else ""),
            "value",
        )
    if not low <= value <= high:
        raise plan_error(f"{type_name} value {value} is outside [{low}, {high}]", "value")


def _check_float(value: object, type_name: str) -> None:
    if type(value) is not float and type(value) is not int:
        raise plan_error(f"{type_name} value {value!r} is not a float", "value")


_U32_BOUNDS: Final = (0, 2**32 - 1)
_I32_BOUNDS: Final = (-(2**31), 2**31 - 1)
_U64_BOUNDS: Final = (0, 2**64 - 1)
_I64_BOUNDS: Final = (-(2**63), 2**63 - 1)


class _Integer(Tagged, frozen=True):
    """Base of the integer scalars: ``value`` is an ``int`` within the type's ``bounds``.

    The field's ``msgspec.Meta`` checks decoded plans; this checks construction.
    """

    value: int
    bounds: ClassVar[tuple[int, int]]
    type_name: ClassVar[ScalarType]

    def __post_init__(self) -> None:
        _check_integer(self.value, self.type_name, *self.bounds)


class U32(_Integer, tag="u32", kw_only=False, frozen=True):
    """An unsigned 32-bit scalar argument."""

    value: Annotated[int, msgspec.Meta(ge=_U32_BOUNDS[0], le=_U32_BOUNDS[1])]
    dtype: ClassVar[DType] = DType.U32
    type_name: ClassVar[ScalarType] = "u32"
    bounds: ClassVar[tuple[int, int]] = _U32_BOUNDS


class I32(_Integer, tag="i32", kw_only=False, frozen=True):
    """A signed 32-bit scalar argument."""

    value: Annotated[int, msgspec.Meta(ge=_I32_BOUNDS[0], le=_I32_BOUNDS[1])]
    dtype: ClassVar[DType] = DType.I32
    type_name: ClassVar[ScalarType] = "i32"
    bounds: ClassVar[tuple[int, int]] = _I32_BOUNDS


class U64(_Integer, tag="u64", kw_only=False, frozen=True):
    """An unsigned 64-bit scalar argument."""

    value: Annotated[int, msgspec.Meta(ge=0)]  # msgspec's own integers end at 2**64 - 1
    dtype: ClassVar[DType] = DType.U64
    type_name: ClassVar[ScalarType] = "u64"
    bounds: ClassVar[tuple[int, int]] = _U64_BOUNDS


class I64(_Integer, tag="i64", kw_only=False, frozen=True):
    """A signed 64-bit scalar argument."""

    value: Annotated[int, msgspec.Meta(ge=_I64_BOUNDS[0], le=_I64_BOUNDS[1])]
    dtype: ClassVar[DType] = DType.I64
    type_name: ClassVar[ScalarType] = "i64"
    bounds: ClassVar[tuple[int, int]] = _I64_BOUNDS


class F32(Tagged, tag="f32", kw_only=False, frozen=True):
    """A 32-bit float scalar argument; finite and within float32's range."""

    value: float
    dtype: ClassVar[DType] = DType.F32
    type_name: ClassVar[ScalarType] = "f32"

    def __post_init__(self) -> None:
        _check_float(self.value, "f32")
        if not math.isfinite(self.value) or abs(self.value) > F32_MAX:
            raise plan_error(f"f32 value {self.value!r} is not a finite float32", "value")


class F64(Tagged, tag="f64", kw_only=False, frozen=True):
    """A 64-bit float scalar argument; finite."""

    value: float
    dtype: ClassVar[DType] = DType.F64
    type_name: ClassVar[ScalarType] = "f64"

    def __post_init__(self) -> None:
        _check_float(self.value, "f64")
        if not math.isfinite(self.value):
            raise plan_error(f"f64 value {self.value!r} is not finite", "value")


ScalarArgument: TypeAlias = U32 | I32 | U64 | I64 | F32 | F64
"""A typed scalar kernel argument: ``U32(5000)`` encodes as ``{"type": "u32", "value": 5000}``."""

SCALAR_CLASSES: Final[dict[str, type[ScalarArgument]]] = {
    "u32": U32,
    "i32": I32,
    "u64": U64,
    "i64": I64,
    "f32": F32,
    "f64": F64,
}
_INTEGER_SCALARS: Final = (U32, I32, U64, I64)


def scalar(type_name: ScalarType, value: int | float) -> ScalarArgument:
    """Build a scalar argument of the named type, checking its range."""
    cls = SCALAR_CLASSES.get(type_name)
    if cls is None:
        raise plan_error(f"unknown scalar type {type_name!r}", "type")
    return convert_plan({"type": type_name, "value": value}, cls)


def integer_value(argument: ScalarArgument) -> int | None:
    """The value of an integer scalar argument, or ``None`` for a float."""
    if isinstance(argument, _INTEGER_SCALARS):
        return argument.value
    return None
